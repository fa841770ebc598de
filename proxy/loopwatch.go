package proxy

import (
	"golang.org/x/sys/unix"
)

// watchPeer watches w's client socket for its peer's close: the loop
// looks at it when the socket reports the close (peerEvent) and calls
// w.gone if the client left. False when the socket cannot be watched.
func (l *relayLoop) watchPeer(w *peerWatch) bool {
	fd := sockFd(w.raw)
	if fd < 0 {
		return false
	}
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if l.wclosed {
		return false
	}
	slot := takeSlot(&l.watched, &l.wfree)
	if l.poll.add(fd, unix.EPOLLRDHUP, slot, sideWatch) != nil {
		l.wfree = append(l.wfree, slot)
		return false
	}
	l.watched[slot], w.slot = w, slot
	return true
}

// unwatchPeer ends w's watch, unless the loop ended it already. Once it
// returns, w.gone is not called.
func (l *relayLoop) unwatchPeer(w *peerWatch) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if int(w.slot) < len(l.watched) && l.watched[w.slot] == w {
		l.endWatch(w)
	}
}

// peerEvent looks at the watched socket of slot, which reported its
// peer's close or a hang-up.
func (l *relayLoop) peerEvent(slot int32) {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	if slot < 0 || int(slot) >= len(l.watched) || l.watched[slot] == nil {
		return // its watch stopped since the report
	}
	w := l.watched[slot]
	end, gone := w.lookClosed()
	if !end {
		return
	}
	l.endWatch(w)
	if gone {
		w.gone()
	}
}

// endWatch takes w's socket out of the set (under wmu); a socket closed
// meanwhile has left it by itself. As with a stream's (end), a slot whose
// socket the set refused to remove is never used again: no later watch is
// reported its events.
func (l *relayLoop) endWatch(w *peerWatch) {
	l.watched[w.slot] = nil
	removed := true
	if !l.wclosed {
		_ = w.raw.Control(func(fd uintptr) { removed = l.poll.remove(int(fd)) == nil })
	}
	if removed {
		l.wfree = append(l.wfree, w.slot)
	}
}

// takeSlot returns a slot of slots from free, or a new one at its end.
func takeSlot[T any](slots *[]*T, free *[]int32) int32 {
	if k := len(*free); k > 0 {
		slot := (*free)[k-1]
		*free = (*free)[:k-1]
		return slot
	}
	*slots = append(*slots, nil)
	return int32(len(*slots) - 1)
}
