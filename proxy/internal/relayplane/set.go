package relayplane

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// ErrNoLoop says the loop could not take a stream (its epoll set refused
// the sockets, or the loop is stopping): the stream stays on its goroutine.
var ErrNoLoop = errors.New("relay loop: cannot watch the stream's sockets")

// ErrLoopStopped ends a stream still in a loop when the proxy closes.
var ErrLoopStopped = &net.OpError{Op: "write", Net: "tcp", Err: errors.New("the relay loop stopped")}

var clientHungUp = &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", unix.EPIPE)}

// Set is a proxy's relay loops (one per processor: its owner starts and
// stops them) and the count of the streams they relayed.
type Set struct {
	mu         sync.Mutex // start and stop
	running    atomic.Pointer[[]*Loop]
	next       atomic.Uint32
	streams    atomic.Uint64 // the streams a loop took and let go
	registered atomic.Uint64 // the sockets a loop registered for a watch
}

// Registered is how many sockets the set's loops registered in their
// epoll sets for a watch: a seat's socket once for as long as it sits.
func (ls *Set) Registered() uint64 { return ls.registered.Load() }

// Streams is how many streams the set's loops took and let go of.
func (ls *Set) Streams() uint64 { return ls.streams.Load() }

// Running is how many loops run.
func (ls *Set) Running() int {
	if loops := ls.running.Load(); loops != nil {
		return len(*loops)
	}
	return 0
}

// Idle reports what each running loop still holds that an idle one must
// not: a watch under way, a watch slot neither free nor a seat's, a
// descriptor in its epoll set beside its eventfd and its seats' sockets
// (nil: nothing). seats is how many seats hold a place in all.
func (ls *Set) Idle() (seats int, err error) {
	loops := ls.running.Load()
	if loops == nil {
		return 0, nil
	}
	var errs []error
	for i, l := range *loops {
		info, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(l.poll.fd))
		if err != nil {
			return 0, err
		}
		l.wmu.Lock()
		held := 0
		for _, w := range l.watched {
			if w.w != nil {
				errs = append(errs, fmt.Errorf("loop %d: a watch is still under way", i))
			}
			if w.seat != nil {
				held++
			}
		}
		watched, free := len(l.watched), len(l.wfree)
		l.wmu.Unlock()
		seats += held
		if watched != free+held {
			errs = append(errs, fmt.Errorf("loop %d: %d watch slots, %d free, %d seats", i, watched, free, held))
		}
		if n := strings.Count(string(info), "tfd:"); n != 1+held {
			errs = append(errs, fmt.Errorf("loop %d: %d descriptors in its epoll set, want %d (its eventfd and %d seats):\n%s", i, n, 1+held, held, info))
		}
	}
	return seats, errors.Join(errs...)
}

// start starts n loops on the clock now, unless they run already; loops
// the system cannot give are done without (their streams stay on their
// goroutines).
func (ls *Set) Start(n int, now func() time.Time) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.running.Load() != nil {
		return
	}
	loops := make([]*Loop, 0, n)
	for range n {
		l, err := newLoop(now)
		if err != nil {
			break
		}
		l.streams, l.registered = &ls.streams, &ls.registered
		loops = append(loops, l)
		go l.run()
	}
	ls.running.Store(&loops)
}

// pick returns a running loop, or nil.
func (ls *Set) Pick() *Loop {
	loops := ls.running.Load()
	if loops == nil || len(*loops) == 0 {
		return nil
	}
	return (*loops)[int(ls.next.Add(1))%len(*loops)]
}

// stop stops every loop and waits until each has ended its streams,
// closed its descriptors and returned. A later start starts new ones.
func (ls *Set) Stop() {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	loops := ls.running.Swap(nil)
	if loops == nil {
		return
	}
	for _, l := range *loops {
		l.halt()
	}
	for _, l := range *loops {
		<-l.exited
	}
}
