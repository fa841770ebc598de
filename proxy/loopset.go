package proxy

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// spareBufs are a relay loop's spare read buffers. A stream in the loop
// holds one only while a read of it is relayed (until its bytes are
// written, or while a size line cut by the read's end is held) and gives it
// back between events: an idle stream holds none. The loop keeps at most
// maxSpareBufs; it shares more, and takes what it lacks, with every
// stream (spareRelayBufs). Only the loop's goroutine uses them.
type spareBufs struct{ bufs [][]byte }

const maxSpareBufs = 8

// take returns a spare buffer.
func (b *spareBufs) take() []byte {
	n := len(b.bufs)
	if n == 0 {
		return newRelayBuf()
	}
	v := b.bufs[n-1]
	b.bufs[n-1] = nil
	b.bufs = b.bufs[:n-1]
	return v
}

// give keeps v, a buffer of take's, for a later take.
func (b *spareBufs) give(v []byte) {
	if len(b.bufs) < maxSpareBufs {
		b.bufs = append(b.bufs, v)
		return
	}
	spareRelayBuf(v)
}

// errNoLoop says the loop could not take a stream (its epoll set refused
// the sockets, or the loop is stopping): the stream stays on its goroutine.
var errNoLoop = errors.New("relay loop: cannot watch the stream's sockets")

// errLoopStopped ends a stream still in a loop when the proxy closes.
var errLoopStopped = &net.OpError{Op: "write", Net: "tcp", Err: errors.New("the relay loop stopped")}

var clientHungUp = &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", unix.EPIPE)}

// loopSet is a Proxy's relay loops: one per processor, started by Serve,
// stopped by Shutdown or Close.
type loopSet struct {
	mu      sync.Mutex // start and stop
	running atomic.Pointer[[]*relayLoop]
	next    atomic.Uint32
	streams atomic.Uint64 // the streams a loop took and let go
}

// start starts n loops on the clock now, unless they run already; loops
// the system cannot give are done without (their streams stay on their
// goroutines).
func (ls *loopSet) start(n int, now func() time.Time) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.running.Load() != nil {
		return
	}
	loops := make([]*relayLoop, 0, n)
	for range n {
		l, err := newRelayLoop(now)
		if err != nil {
			break
		}
		loops = append(loops, l)
		go l.run()
	}
	ls.running.Store(&loops)
}

// pick returns a running loop, or nil.
func (ls *loopSet) pick() *relayLoop {
	loops := ls.running.Load()
	if loops == nil || len(*loops) == 0 {
		return nil
	}
	return (*loops)[int(ls.next.Add(1))%len(*loops)]
}

// stop stops every loop and waits until each has ended its streams,
// closed its descriptors and returned. A later start starts new ones.
func (ls *loopSet) stop() {
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
