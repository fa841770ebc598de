package relayplane

import (
	"golang.org/x/sys/unix"
)

// Watched is a client socket a loop watches for its peer's close while its
// request waits (the goroutine-free form of a peer watch).
type Watched interface {
	// Control runs f with the socket's descriptor; an error when it is
	// closed.
	Control(f func(fd uintptr)) error
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
// cannot be watched.
func (l *Loop) Watch(w Watched) (int32, bool) {
	fd := -1
	if w.Control(func(f uintptr) { fd = int(f) }) != nil || fd < 0 {
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
	l.watched[slot] = watchSlot{w}
	return slot, true
}

// watchSlot is a watch in its slot (a pointer, for takeSlot).
type watchSlot struct{ w Watched }

// Unwatch ends the watch of w in slot, unless the loop ended it already.
// Once it returns, w.Gone is not called.
func (l *Loop) Unwatch(slot int32, w Watched) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if int(slot) < len(l.watched) && l.watched[slot].w == w {
		l.endWatch(slot)
	}
}

// peerEvent looks at the watched socket of slot, which reported its
// peer's close or a hang-up.
func (l *Loop) peerEvent(slot int32) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if slot < 0 || int(slot) >= len(l.watched) || l.watched[slot].w == nil {
		return // its watch stopped since the report
	}
	w := l.watched[slot].w
	end, gone := w.Look()
	if !end {
		return
	}
	l.endWatch(slot)
	if gone {
		w.Gone()
	}
}

// endWatch takes the socket watched in slot out of the set (under wmu);
// a socket closed meanwhile has left it by itself. As with a stream's
// (end), a slot whose socket the set refused to remove is never used
// again: no later watch is reported its events.
func (l *Loop) endWatch(slot int32) {
	w := l.watched[slot].w
	l.watched[slot] = watchSlot{}
	removed := true
	if !l.wclosed {
		_ = w.Control(func(fd uintptr) { removed = l.poll.remove(int(fd)) == nil })
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
