// Package relayplane relays established streams for many requests on a
// few goroutines: the relay loops (Loop, one per processor in a Set), each
// driven by an epoll set of its own (poller), level-triggered; the watch of
// a waiting request's client socket for its peer's close (Watch); and the
// socket helpers and spare buffers they share with the goroutine path
// (Peek, HungUp, Fd, NewBuf). It knows descriptors, slots and the three
// methods of a Stream, never a request: what a stream is, how it is
// measured and recorded, is its owner's.
package relayplane

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"golang.org/x/sys/unix"
)

// Loop relays established streams (tokentap's chunked streams once the
// response header is out) for many requests on one goroutine, driven by an
// epoll set of its own (poller), level-triggered.
//
// On the goroutine path every relayed event costs a wake-up of the
// request's goroutine and two reads of the upstream socket: the runtime's
// poller is edge-triggered and forgets a socket's readiness before each
// read, so only a read that fails with EAGAIN can tell a goroutine to park.
// Here a short read ends a stream's turn (the level-triggered set reports
// the socket again if more arrives), one epoll_wait serves every stream
// that is ready, and no goroutine is woken per event: one read, one write.
//
// The loop's goroutine parks in the runtime's poller on the epoll
// descriptor itself (an epoll set is readable while it has events), so an
// idle loop holds no thread; how it parks and yields when many goroutines
// are runnable is crowding's. As it lets go of a stream (Ended) its owner
// carries it on, on a goroutine of its own.
//
// The loop sees a stream only through Stream (what to read, what was
// written, what else befell it) and its two descriptors. It uses the
// connections' own descriptors, so nothing may close them while it holds
// them: an owner that closes a connection from another goroutine (a client
// that left, a drain cut short) only shuts the socket down then, which
// the loop sees at once (the upstream reads its end, the client's socket
// reports a hang-up), and the close waits for the stream to leave the
// loop. (Duplicating the descriptors would double what each stream holds:
// 9,000 idle streams ran out of the process's 20,000.)
//
// Timeouts are the goroutine path's: the upstream's idle gap between reads
// and the client's write timeout, on the owner's clock. The loop wakes for
// them only when the earliest can have passed (an epoll set has no timers:
// a read deadline on its file does it), never per event.
//
// The loops belong to a Set, whose owner starts and stops them; stopping
// ends the streams still in them and closes their descriptors.
type Loop struct {
	poll   *poller
	efd    int // eventfd: streams posted to the loop, and the stop
	file   *os.File
	raw    syscall.RawConn
	now    func() time.Time
	turnFn func(fd uintptr) bool
	events []unix.EpollEvent
	efdBuf [8]byte
	mu     sync.Mutex
	posted []*Handle
	stop   bool // under mu: no more posts; the loop ends its streams and exits
	taken  []*Handle
	slots  []*Handle // by slot; nil: free
	free   []int32
	// freed are slots ended during the batch being served: they are
	// reused only from the next batch, so that an event of the batch for
	// an ended stream never reaches a stream that took its slot.
	freed []int32
	// due is when the earliest timeout of an open stream can fire (zero:
	// none); armed is the due the epoll file's read deadline is set for.
	// A stream's activity only moves its timeouts later, so due is a
	// bound, renewed by each check (scan).
	due     time.Time
	armed   time.Time
	spare   spareBufs     // read buffers lent to its streams (spareBufs)
	again   bool          // a read filled the buffer: look again before parking
	more    bool          // events are left after a batch: yield, then serve them
	pace    pacing        // how it parks and yields (crowding)
	exiting bool          // the loop's own: stop was seen
	exited  chan struct{} // closed when the goroutine has closed the descriptors and returned

	// Client sockets watched for their peer's close while their request
	// waits (Watch, Seat), by slot: registered and ended by the requests'
	// goroutines, reported to the loop's; under wmu, which a verdict is
	// given under, so that a watch that stopped is never called.
	wmu     sync.Mutex
	watched []watchSlot
	wfree   []int32
	wclosed bool // the epoll set is closed: no more watches

	// Its set's counts: the streams let go of (end), and the sockets
	// registered for a watch (Watch, and a Seat's first).
	streams, registered *atomic.Uint64
}

// loopBatch is how many ready events a loop serves before it lets other
// goroutines run: about a millisecond of relaying.
const loopBatch = 64

// efdSlot marks the eventfd's events; a stream's slot is an index.
const efdSlot = -1

// Handle is one stream while a loop relays it: what its owner sets before
// Post (the stream, the two descriptors, held open for the loop while it
// relays, and the timeouts), and the loop's own state of it. It lives in
// its owner and is reused by the owner's next stream.
type Handle struct {
	S            Stream
	UpFd, ClFd   int
	Idle         time.Duration // the upstream's idle timeout (0: none)
	WriteTimeout time.Duration // the client's write timeout (0: none)

	bufs   *spareBufs // the loop's, for the stream's reads
	slot   int32
	readAt time.Time // when reading began or last returned bytes, for the idle timeout
	// pending is what of the read being relayed is still to be written.
	pending []byte
	since   time.Time // when pending met a full socket buffer
	blocked bool      // waiting for the client socket to take pending
	rdhup   bool      // the client's close is watched (see clientClosed)
}

// TakeBuf returns a read buffer of the loop's spares, for the stream's
// Read; GiveBuf gives it back between events. Only from the Stream's
// methods, on the loop's goroutine.
func (s *Handle) TakeBuf() []byte { return s.bufs.take() }

// GiveBuf: see TakeBuf.
func (s *Handle) GiveBuf(b []byte) { s.bufs.give(b) }

func newLoop(now func() time.Time) (*Loop, error) {
	poll, err := newPoller()
	if err != nil {
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		metrics.RelayLoopError("create")
		unix.Close(poll.fd)
		return nil, err
	}
	if err = poll.add(efd, unix.EPOLLIN, efdSlot, sideUp); err == nil {
		err = unix.SetNonblock(poll.fd, true)
	}
	if err != nil {
		unix.Close(efd)
		unix.Close(poll.fd)
		return nil, err
	}
	f := os.NewFile(uintptr(poll.fd), "relay-loop")
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		unix.Close(efd)
		return nil, err
	}
	if f.SetReadDeadline(time.Time{}) != nil {
		// Not in the runtime's poller: the loop could not park on it.
		f.Close()
		unix.Close(efd)
		metrics.RelayLoopError("create")
		return nil, errors.New("epoll descriptor is not pollable")
	}
	l := &Loop{poll: poll, efd: efd, file: f, raw: raw, now: now, events: make([]unix.EpollEvent, loopBatch),
		exited: make(chan struct{}), pace: newPacing()}
	l.turnFn = l.turn
	return l, nil
}

// run serves the loop until it is stopped. Between turns it checks the
// open streams' timeouts when the earliest is due, and moves the epoll
// file's read deadline, which wakes the loop, to the next one.
func (l *Loop) run() {
	defer close(l.exited)
	for {
		_ = l.raw.Read(l.turnFn) // a deadline: a timeout may be due
		if l.exiting {
			l.wmu.Lock()
			l.wclosed = true
			l.wmu.Unlock()
			_ = l.file.Close()
			_ = unix.Close(l.efd)
			return
		}
		l.pace.rest(l.more)
		l.more = false
		if now := l.now(); !l.due.IsZero() && !now.Before(l.due) {
			l.scan(now)
		}
		rt := time.Now()
		poll := l.pace.poll(rt)
		if !l.armed.Equal(l.due) || !poll.Equal(l.pace.pollAt) {
			// The file's deadline is on the runtime's clock: the time left
			// on the owner's, or a busy loop's poll if sooner.
			at := l.due
			if !at.IsZero() {
				at = rt.Add(l.due.Sub(l.now()))
			}
			if !poll.IsZero() && (at.IsZero() || poll.Before(at)) {
				at = poll
			}
			_ = l.file.SetReadDeadline(at)
			l.armed, l.pace.pollAt = l.due, poll
		}
	}
}

// expect makes sure the loop wakes by t to check the timeouts.
func (l *Loop) expect(t time.Time) {
	if l.due.IsZero() || t.Before(l.due) {
		l.due = t
	}
}

// turn serves the ready events, a batch at a time (false: none left, park
// until the epoll set is readable); it returns true when more are ready
// after a batch (more), when the streams' timeouts are due, when the
// deadline that checks them must change, or when the loop stops.
func (l *Loop) turn(uintptr) bool {
	for {
		n, e := l.poll.wait(l.events)
		if e != 0 {
			return true
		}
		l.again = false
		for i := range n {
			ev := &l.events[i]
			if ev.Fd == efdSlot {
				l.takePosted()
				continue
			}
			if ev.Pad == sideWatch {
				l.peerEvent(ev.Fd)
				continue
			}
			s := l.slots[ev.Fd]
			if s == nil {
				continue // ended earlier in this batch
			}
			switch {
			case ev.Pad == sideClient && s.blocked && ev.Events&unix.EPOLLOUT != 0:
				l.write(s)
			case ev.Pad == sideClient && ev.Events&(unix.EPOLLHUP|unix.EPOLLERR) != 0:
				l.end(s, clientHungUp)
			case ev.Pad == sideClient && ev.Events&unix.EPOLLRDHUP != 0 && s.rdhup:
				l.clientClosed(s)
			case ev.Pad == sideUp && !s.blocked:
				l.read(s, ev.Events)
			}
		}
		l.free = append(l.free, l.freed...)
		l.freed = l.freed[:0]
		if l.exiting {
			return true
		}
		if !l.armed.Equal(l.due) || !l.due.IsZero() && !l.now().Before(l.due) {
			return true
		}
		l.pace.look()
		if n < len(l.events) && !l.again {
			// Nothing is ready: park here on the poller, or in run as the
			// crowding says.
			return !l.pace.parks()
		}
		// More is ready: first let the goroutines waiting for the
		// processor run (run yields), as each stream's goroutine would have
		// after its event. A loop that served every ready event before
		// yielding held new requests back by whole waves of events.
		l.more = true
		return true
	}
}

// post hands s to the loop; false when the loop is stopping (the stream
// stays on its goroutine).
func (l *Loop) Post(s *Handle) bool {
	l.mu.Lock()
	if l.stop {
		l.mu.Unlock()
		return false
	}
	l.posted = append(l.posted, s)
	l.mu.Unlock()
	l.wake()
	return true
}

// halt makes the loop end its streams (ErrLoopStopped), close its
// descriptors and return; posts fail from now on.
func (l *Loop) halt() {
	l.mu.Lock()
	l.stop = true
	l.mu.Unlock()
	l.wake()
}

// wake writes the loop's eventfd (non-blocking: the call never waits).
func (l *Loop) wake() {
	one := [8]byte{1}
	for {
		if _, e := sock.Write(uintptr(l.efd), one[:]); e != unix.EINTR {
			return // EAGAIN: the counter is full, the loop is woken anyway
		}
	}
}

// takePosted registers the streams posted since the last turn, or ends
// every stream when the loop stops.
func (l *Loop) takePosted() {
	_, _, _ = unix.RawSyscall(unix.SYS_READ, uintptr(l.efd), uintptr(unsafe.Pointer(&l.efdBuf[0])), 8)
	l.mu.Lock()
	l.taken, l.posted = l.posted, l.taken[:0]
	stop := l.stop
	l.mu.Unlock()
	now := l.now()
	for i, s := range l.taken {
		l.taken[i] = nil
		slot := takeSlot(&l.slots, &l.free)
		s.slot, s.readAt, s.rdhup, s.bufs = slot, now, true, &l.spare
		// The client's socket: its peer's close (the peer watch's job on
		// the goroutine path), hang-ups and errors, until it is written to.
		if l.poll.add(s.UpFd, upEvents, slot, sideUp) != nil {
			l.free = append(l.free, slot)
			s.S.Note(Event{Kind: Ended, Err: ErrNoLoop})
			continue
		}
		if l.poll.add(s.ClFd, s.clientEvents(), slot, sideClient) != nil {
			if l.poll.remove(s.UpFd) == nil {
				l.free = append(l.free, slot)
			}
			s.S.Note(Event{Kind: Ended, Err: ErrNoLoop})
			continue
		}
		l.slots[slot] = s
		s.S.Note(Event{Kind: Entered})
		if s.Idle > 0 {
			l.expect(now.Add(s.Idle))
		}
	}
	l.taken = l.taken[:0]
	if stop {
		for _, s := range l.slots {
			if s != nil {
				s.S.Note(Event{Kind: Failed, Err: ErrLoopStopped, KeepRead: true})
				l.end(s, ErrLoopStopped)
			}
		}
		l.exiting = true
	}
}

// upEvents is what the loop waits for on a stream's upstream socket: its
// data, and its end (EPOLLRDHUP), so that a read can tell whether the end
// is still waiting behind the bytes it took.
const upEvents = unix.EPOLLIN | unix.EPOLLRDHUP

// read relays one read of the upstream socket, reported ready with events.
//
// A socket that is still readable after its read (its end, or a reset,
// waits behind the bytes taken) must be looked at again before the loop
// parks: the set is level-triggered, so the next epoll_wait reports it,
// but the runtime's poller watches the epoll descriptor edge-triggered, and
// a socket that stays ready makes no new edge. Only an event that arrives
// wakes a parked loop: the end of a stream that came with its last bytes
// (an upstream that wrote and reset at once) was left unread until the
// idle timeout, its record with it.
func (l *Loop) read(s *Handle, events uint32) {
	out, wait, got, again := s.S.Read(s.UpFd, events)
	if wait {
		return
	}
	if got {
		s.readAt = l.now()
	}
	l.again = l.again || again
	s.pending = out
	l.write(s)
}

// write writes what is pending of the read being relayed; at a full
// socket buffer it stops reading the upstream and waits for the client's
// socket to be writable.
func (l *Loop) write(s *Handle) {
	for len(s.pending) > 0 {
		n, e := sock.Write(uintptr(s.ClFd), s.pending)
		switch e {
		case 0:
			s.S.Note(Event{Kind: Sent, N: n})
			s.pending = s.pending[n:]
			continue
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			if !s.blocked {
				s.blocked, s.since = true, l.now()
				if s.WriteTimeout > 0 {
					l.expect(s.since.Add(s.WriteTimeout))
				}
				// The upstream is not read until the client takes pending:
				// only its hang-up, once (level-triggered, it would be
				// reported on every turn).
				l.interest(s, unix.EPOLLONESHOT)
			}
			return
		}
		err := &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", e)}
		s.S.Note(Event{Kind: Failed, Err: err, KeepRead: true})
		l.end(s, err)
		return
	}
	if s.blocked {
		s.blocked, s.readAt = false, l.now()
		s.S.Note(Event{Kind: Stalled, D: s.readAt.Sub(s.since)})
		if !l.interest(s, upEvents) {
			return
		}
		if s.Idle > 0 {
			l.expect(s.readAt.Add(s.Idle))
		}
	}
	if end, err := s.S.Written(); end {
		l.end(s, err)
	}
}

// interest sets what the loop waits for on s's upstream socket (up), and
// on its client socket what s's state says (clientEvents). A set that
// refuses the change ends the stream with its error: its sockets would
// no longer be watched as the stream needs (false).
func (l *Loop) interest(s *Handle, up uint32) bool {
	if err := l.poll.modify(s.UpFd, up, s.slot, sideUp); err != nil {
		l.fail(s, err)
		return false
	}
	return l.watchClient(s)
}

// watchClient sets what the loop waits for on s's client socket.
func (l *Loop) watchClient(s *Handle) bool {
	if err := l.poll.modify(s.ClFd, s.clientEvents(), s.slot, sideClient); err != nil {
		l.fail(s, err)
		return false
	}
	return true
}

// fail ends s because its sockets cannot be watched.
func (l *Loop) fail(s *Handle, err error) {
	e := &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("epoll_ctl", err)}
	s.S.Note(Event{Kind: Failed, Err: e, KeepRead: true})
	l.end(s, e)
}

// clientClosed answers the client's socket reporting its peer's close
// (EPOLLRDHUP), as the peer watch answers a readable socket on the
// goroutine path: one look without consuming tells a client that left
// (nothing waiting) from one that sent more and then closed its side (bytes
// waiting, a pipelined request: closure cannot be told without reading, and
// the stream goes on). A client that left is told to the stream
// (ClientLeft), whose owner cancels it as its peer watch would: shutting
// the upstream socket down ends the stream on this loop's next turn.
// Either way the close is not reported again.
func (l *Loop) clientClosed(s *Handle) {
	state := sock.Peek(uintptr(s.ClFd))
	s.rdhup = false
	if !l.watchClient(s) {
		return
	}
	if state != sock.PeerData {
		s.S.Note(Event{Kind: ClientLeft})
	}
}

// clientEvents is what the loop waits for on s's client socket besides
// hang-ups and errors: writability while blocked, the peer's close while
// watched.
func (s *Handle) clientEvents() uint32 {
	var ev uint32
	if s.blocked {
		ev |= unix.EPOLLOUT
	}
	if s.rdhup {
		ev |= unix.EPOLLRDHUP
	}
	return ev
}

// end takes s out of the loop and hands it back with err. A slot
// whose sockets the set may still report (a removal it refused) is never
// used again.
func (l *Loop) end(s *Handle, err error) {
	e1, e2 := l.poll.remove(s.UpFd), l.poll.remove(s.ClFd)
	l.slots[s.slot] = nil
	if e1 == nil && e2 == nil {
		l.freed = append(l.freed, s.slot)
	}
	s.pending = nil
	if l.streams != nil {
		l.streams.Add(1)
	}
	s.S.Note(Event{Kind: Ended, Err: err})
}

// scan ends the streams whose upstream was silent for their idle timeout
// or whose client did not take a write for the write timeout, and finds
// when the next timeout can fire.
func (l *Loop) scan(now time.Time) {
	l.due = time.Time{}
	for _, s := range l.slots {
		switch {
		case s == nil:
		case s.blocked && s.WriteTimeout > 0:
			l.timeOut(s, now, s.since.Add(s.WriteTimeout), "write", true)
		case !s.blocked && s.Idle > 0:
			l.timeOut(s, now, s.readAt.Add(s.Idle), "read", false)
		}
	}
}

// timeOut ends s with a timeout of op (keepRead: see Failed) once now is
// past at, and else makes sure the loop wakes for it.
func (l *Loop) timeOut(s *Handle, now, at time.Time, op string, keepRead bool) {
	if !now.After(at) {
		l.expect(at)
		return
	}
	err := &net.OpError{Op: op, Net: "tcp", Err: os.ErrDeadlineExceeded}
	s.S.Note(Event{Kind: Failed, Err: err, KeepRead: keepRead})
	l.end(s, err)
}
