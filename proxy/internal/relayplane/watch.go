package relayplane

import (
	"sync"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"golang.org/x/sys/unix"
)

// Watched is a client socket a loop watches for its peer's close while its
// request waits (the goroutine-free form of a peer watch).
type Watched interface {
	// Control runs f with the socket's descriptor; an error when it is
	// closed.
	sock.Controller
	// Look looks at the socket once it reported its peer's close or a
	// hang-up: whether the watch ends, and whether the client is gone.
	Look() (end, gone bool)
	// Gone: the client left. Called at most once, under the loop's
	// watch lock: never after Unwatch returned.
	Gone()
}

// Watch watches w's socket for its peer's close: the loop looks at it when
// the socket reports the close (peerEvent) and calls w.Gone if the client
// left. It returns the watch's slot, for Unwatch; false when the socket
// cannot be watched. The socket leaves the set when the watch ends: for a
// connection that serves requests one after another, a Seat keeps it in.
func (l *Loop) Watch(w Watched) (int32, bool) { return l.watch(w, nil) }

// watch registers w's socket in a free slot, for seat when it is not nil.
func (l *Loop) watch(w Watched, seat *Seat) (int32, bool) {
	fd := sock.Fd(w)
	if fd < 0 {
		return 0, false
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.wclosed {
		return 0, false
	}
	slot := takeSlot(&l.watched, &l.wfree)
	if l.poll.add(fd, unix.EPOLLRDHUP, slot, sideWatch) != nil {
		l.wfree = append(l.wfree, slot)
		return 0, false
	}
	l.watched[slot] = watchSlot{w: w, seat: seat, fd: fd}
	if l.registered != nil {
		l.registered.Add(1)
	}
	return slot, true
}

// watchSlot is a watch in its slot: the watch (nil: a seat's socket
// between watches), the seat it sits in (nil: the watch's own
// registration) and, for a seat, its socket's descriptor.
type watchSlot struct {
	w    Watched
	seat *Seat
	fd   int
}

// Unwatch ends the watch of w in slot, unless the loop ended it already.
// Once it returns, w.Gone is not called.
func (l *Loop) Unwatch(slot int32, w Watched) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if int(slot) < len(l.watched) && l.watched[slot].w == w && l.watched[slot].seat == nil {
		l.endWatch(slot)
	}
}

// peerEvent looks at the watched socket of slot, which reported its
// peer's close or a hang-up. A seat's socket between watches leaves the
// set: its connection's next request would find it gone anyway, and the
// set is level-triggered (the report would come back on every turn).
func (l *Loop) peerEvent(slot int32) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if slot < 0 || int(slot) >= len(l.watched) {
		return
	}
	ws := l.watched[slot]
	if ws.w == nil {
		if ws.seat != nil {
			l.endWatch(slot)
		}
		return // its watch stopped since the report
	}
	end, gone := ws.w.Look()
	if !end {
		return
	}
	l.endWatch(slot)
	if gone {
		ws.w.Gone()
	}
}

// endWatch takes the socket watched in slot out of the set (under wmu).
// A watch's own socket closed meanwhile has left it by itself; a seat's is
// open until its owner left the seat. As with a stream's (end), a slot
// whose socket the set refused to remove is never used again: no later
// watch is reported its events.
func (l *Loop) endWatch(slot int32) {
	ws := l.watched[slot]
	l.watched[slot] = watchSlot{}
	removed := true
	switch {
	case l.wclosed:
	case ws.seat != nil:
		removed = l.poll.remove(ws.fd) == nil
	default:
		_ = ws.w.Control(func(fd uintptr) { removed = l.poll.remove(int(fd)) == nil })
	}
	if removed {
		l.wfree = append(l.wfree, slot)
	}
}

// takeSlot returns a slot of slots from free, or a new one at its end.
func takeSlot[T any](slots *[]T, free *[]int32) int32 {
	if k := len(*free); k > 0 {
		slot := (*free)[k-1]
		*free = (*free)[:k-1]
		return slot
	}
	var zero T
	*slots = append(*slots, zero)
	return int32(len(*slots) - 1)
}

// A Seat is a socket's standing place in a loop's watch set, for a
// connection that serves one request after another: its first watch
// registers the socket (one epoll_ctl ADD), and it stays registered
// between requests, so that each later watch and its end make no system
// call. Its owner gives the place up before the socket closes (Leave), and
// before a stream of the same loop takes the socket over; the loop gives
// it up itself when the socket reports its peer's close between watches.
//
// Its methods may be called from any goroutine (the connection's close
// comes from whoever closes it); its place is the loop's to confirm, under
// the loop's watch lock.
type Seat struct {
	mu   sync.Mutex
	loop *Loop
	slot int32
}

// Watch watches w's socket from the seat: in the loop it sits in, with no
// system call, or else in a loop of set, where it registers the socket and
// sits from then on. False when no loop can watch it.
func (s *Seat) Watch(set *Set, w Watched) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loop != nil {
		if s.loop.reseat(s, w) {
			return true
		}
		s.loop = nil // the loop gave the place up, or stopped
	}
	l := set.Pick()
	if l == nil {
		return false
	}
	slot, ok := l.watch(w, s)
	if !ok {
		return false
	}
	s.loop, s.slot = l, slot
	return true
}

// Unwatch ends the watch of w; the socket keeps its place. Once it
// returns, w.Gone is not called.
func (s *Seat) Unwatch(w Watched) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loop != nil {
		s.loop.unseat(s, w)
	}
}

// LeaveFor gives the seat's place up if it is in l: a stream of l is
// about to register the socket itself (a socket is in an epoll set once).
func (s *Seat) LeaveFor(l *Loop) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.loop == l {
		s.leave()
	}
}

// Leave gives the seat's place up: the socket leaves the loop's epoll set
// (unless the loop gave the place up already). Its owner calls it before
// the socket closes: a descriptor number the loop still held could name
// another socket by then.
func (s *Seat) Leave() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.leave()
}

// leave is Leave under s.mu.
func (s *Seat) leave() {
	if l := s.loop; l != nil {
		s.loop = nil
		l.wmu.Lock()
		defer l.wmu.Unlock()
		if l.holds(s) {
			l.endWatch(s.slot)
		}
	}
}

// holds reports whether s still sits in its slot of l (under wmu).
func (l *Loop) holds(s *Seat) bool {
	return !l.wclosed && int(s.slot) < len(l.watched) && l.watched[s.slot].seat == s
}

// reseat watches w from s's place in l; false when s sits there no more.
func (l *Loop) reseat(s *Seat, w Watched) bool {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if !l.holds(s) {
		return false
	}
	l.watched[s.slot].w = w
	return true
}

// unseat ends the watch of w from s's place in l; the socket stays.
func (l *Loop) unseat(s *Seat, w Watched) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.holds(s) && l.watched[s.slot].w == w {
		l.watched[s.slot].w = nil
	}
}
