package relayplane

import (
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// fdWatch is a Watched over a socket of the test's: the peer watch's
// verdicts without a connection or a server.
type fdWatch struct {
	fd   int
	gone chan struct{}
}

func newFdWatch(fd int) *fdWatch { return &fdWatch{fd: fd, gone: make(chan struct{}, 4)} }

func (w *fdWatch) Control(f func(fd uintptr)) error { f(uintptr(w.fd)); return nil }

func (w *fdWatch) Look() (end, gone bool) {
	switch sock.Peek(uintptr(w.fd)) {
	case sock.PeerIdle:
		return false, false
	case sock.PeerClosed:
		return true, true
	}
	return true, false
}

func (w *fdWatch) Gone() { w.gone <- struct{}{} }

// waitIdle waits until the set's loops hold want seats and nothing a quiet
// loop must not.
func waitIdle(t *testing.T, ls *Set, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		seats, err := ls.Idle()
		if err == nil && seats == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d seats, want %d: %v", seats, want, err)
		}
		time.Sleep(time.Millisecond)
	}
}

// watchOnce watches w from seat and ends the watch: the socket keeps its
// place.
func watchOnce(t *testing.T, ls *Set, seat *Seat, w *fdWatch) {
	t.Helper()
	if !seat.Watch(ls, w) {
		t.Fatal("the watch was not taken")
	}
	seat.Unwatch(w)
}

// A seat registers its socket once, for watch after watch, and gives its
// place up when it leaves: the epoll set then holds the eventfd alone.
func TestSeatRegistersOnceAndLeaves(t *testing.T) {
	ls, _ := startLoop(t)
	fd, _ := sockPair(t)
	var seat Seat
	for range 50 {
		watchOnce(t, ls, &seat, newFdWatch(fd))
	}
	if n := ls.Registered(); n != 1 {
		t.Fatalf("50 watches from one seat registered its socket %d times, want 1", n)
	}
	waitIdle(t, ls, 1)
	seat.Leave()
	waitIdle(t, ls, 0)
	seat.Leave() // a second leave does nothing
	waitIdle(t, ls, 0)
}

// The peer's close is told to the watch under way, once; a close between
// watches makes the loop give the place up (the set is level-triggered),
// and the next watch registers the socket again and is told at once.
func TestSeatPeerCloses(t *testing.T) {
	ls, _ := startLoop(t)
	fd, peer := sockPair(t)
	var seat Seat
	w := newFdWatch(fd)
	watchOnce(t, ls, &seat, w)
	peer.Close()
	waitIdle(t, ls, 0) // given up by the loop, not by the seat
	w2 := newFdWatch(fd)
	if !seat.Watch(ls, w2) {
		t.Fatal("the next watch was not taken")
	}
	if n := ls.Registered(); n != 2 {
		t.Fatalf("registered %d times, want 2 (again after the loop gave the place up)", n)
	}
	select {
	case <-w2.gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the watch was never told its peer had left")
	}
	seat.Unwatch(w2)
	select {
	case <-w.gone:
		t.Fatal("a watch that had ended was told its peer left")
	default:
	}
	if len(w2.gone) != 0 {
		t.Fatal("told twice")
	}
	seat.Leave()
	waitIdle(t, ls, 0)
}

// A seat in a loop that stopped is not watched from there: the next watch
// sits in a running loop, or is refused when none runs.
func TestSeatAfterItsLoopStopped(t *testing.T) {
	ls := &Set{}
	ls.Start(1, time.Now)
	if ls.Running() == 0 {
		t.Skip("no relay loop on this system")
	}
	fd, _ := sockPair(t)
	var seat Seat
	w := newFdWatch(fd)
	watchOnce(t, ls, &seat, w)
	ls.Stop()
	if seat.Watch(ls, w) {
		t.Fatal("watched with no loop running")
	}
	ls.Start(1, time.Now)
	defer ls.Stop()
	watchOnce(t, ls, &seat, w) // by the new loop
	seat.Leave()
	waitIdle(t, ls, 0)
}
