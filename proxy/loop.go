package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// relayLoop relays established chunked streams (passChunks once the
// response header is out) for many exchanges on one goroutine, driven by
// an epoll set of its own, level-triggered.
//
// On the goroutine path every relayed event costs a wake-up of the
// exchange's goroutine and two reads of the upstream socket: the runtime's
// poller is edge-triggered and forgets a socket's readiness before each
// read, so only a read that fails with EAGAIN can tell a goroutine to park.
// Here a short read ends a stream's turn (the level-triggered set reports
// the socket again if more arrives), one epoll_wait serves every stream
// that is ready, and no goroutine is woken per event: one read, one write.
//
// The loop's goroutine parks in the runtime's poller on the epoll
// descriptor itself (an epoll set is readable while it has events), so an
// idle loop holds no thread and the loops do not compete with the
// runtime's scheduler. The exchange's own goroutine waits on a channel
// until its stream ends, then hands the connection back to the server as
// before.
//
// The loop uses the connections' own descriptors, so nothing may close
// them while it holds them: the two paths that close a connection from
// another goroutine (a client that left: cancelState.fire; a drain cut
// short: clientConn.Close) only shut the socket down then, which the loop
// sees at once (the upstream reads its end, the client's socket reports a
// hang-up), and the close waits for the stream to leave the loop.
// (Duplicating the descriptors instead would double what each stream
// holds: 9,000 idle streams ran out of the process's 20,000.)
//
// Timeouts are the goroutine path's: the upstream's idle gap between reads
// and the client's write timeout. The loop wakes for them only when the
// earliest can have passed (an epoll set has no timers: a read deadline
// on its file does it), never per event.
type relayLoop struct {
	epfd   int
	efd    int // eventfd: streams posted to the loop
	file   *os.File
	raw    syscall.RawConn
	turnFn func(fd uintptr) bool
	events []unix.EpollEvent
	efdBuf [8]byte
	mu     sync.Mutex
	posted []*loopStream
	taken  []*loopStream
	slots  []*loopStream // by slot; nil: free
	free   []int32
	// freed are slots ended during the batch being served: they are
	// reused only from the next batch, so that an event of the batch for
	// an ended stream never reaches a stream that took its slot.
	freed []int32
	// due is when the earliest timeout of an open stream can fire (zero:
	// none); armed is the epoll file's read deadline, which wakes the loop.
	// A stream's activity only moves its timeouts later, so due is a
	// bound, renewed by each check (scan).
	due   time.Time
	armed time.Time
	again bool // a read filled the buffer: look again before parking
	more  bool // events are left after a batch: yield, then serve them
}

// loopBatch is how many ready events a loop serves before it lets other
// goroutines run: about a millisecond of relaying.
const loopBatch = 64

// efdSlot marks the eventfd's events; a stream's slot is an index.
const efdSlot = -1

// loopStream is one stream while the loop relays it. It lives in its
// exchange and is reused by the exchange's next stream.
type loopStream struct {
	x      *exchange
	cc     *clientConn
	slot   int32
	upFd   int // the connections' descriptors, held open for the loop
	clFd   int
	done   chan error
	idle   time.Duration
	wtime  time.Duration
	readAt time.Time // when reading began or last returned bytes, for the idle timeout
	// The read being relayed: what of x.buf is still to be written, the
	// end of the bytes read, the data bytes found, the read's error.
	pending []byte
	since   time.Time // when pending met a full socket buffer
	blocked bool      // waiting for the client socket to take pending
	rdhup   bool      // the client's close is watched (see clientClosed)
	last    int
	data    int
	wrote   bool
	readErr error
}

var (
	loopsOnce   sync.Once
	loops       []*relayLoop
	loopNext    atomic.Uint32
	loopStreams atomic.Uint64 // streams handed to a relay loop
)

// pickLoop returns a relay loop (one per processor the runtime had when
// the first stream came), or nil when the system has none to give.
func pickLoop() *relayLoop {
	loopsOnce.Do(func() {
		for range runtime.GOMAXPROCS(0) {
			l, err := newRelayLoop()
			if err != nil {
				break
			}
			loops = append(loops, l)
			go l.run()
		}
	})
	if len(loops) == 0 {
		return nil
	}
	return loops[int(loopNext.Add(1))%len(loops)]
}

func newRelayLoop() (*relayLoop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(epfd)
		return nil, err
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: efdSlot}
	if err = unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, efd, &ev); err == nil {
		err = unix.SetNonblock(epfd, true)
	}
	if err != nil {
		unix.Close(efd)
		unix.Close(epfd)
		return nil, err
	}
	f := os.NewFile(uintptr(epfd), "relay-loop")
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
		return nil, errors.New("epoll descriptor is not pollable")
	}
	l := &relayLoop{epfd: epfd, efd: efd, file: f, raw: raw, events: make([]unix.EpollEvent, loopBatch)}
	l.turnFn = l.turn
	return l, nil
}

// run serves the loop for the life of the process. Between turns it
// checks the open streams' timeouts when the earliest is due, and moves
// the epoll file's read deadline, which wakes the loop, to the next one.
func (l *relayLoop) run() {
	for {
		_ = l.raw.Read(l.turnFn) // a deadline: a timeout may be due
		if l.more {
			l.more = false
			runtime.Gosched()
		}
		if !l.due.IsZero() && !time.Now().Before(l.due) {
			l.scan(time.Now())
		}
		if !l.armed.Equal(l.due) {
			_ = l.file.SetReadDeadline(l.due)
			l.armed = l.due
		}
	}
}

// expect makes sure the loop wakes by t to check the timeouts.
func (l *relayLoop) expect(t time.Time) {
	if l.due.IsZero() || t.Before(l.due) {
		l.due = t
	}
}

// turn serves the ready events, a batch at a time (false: none left, park
// until the epoll set is readable); it returns true when more are ready
// after a batch (more), when the streams' timeouts are due or when the
// deadline that checks them must change.
func (l *relayLoop) turn(uintptr) bool {
	for {
		n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(l.epfd), uintptr(unsafe.Pointer(&l.events[0])),
			uintptr(len(l.events)), 0, 0, 0)
		if e != 0 {
			if e == unix.EINTR {
				continue
			}
			return true
		}
		l.again = false
		for i := range int(n) {
			ev := &l.events[i]
			if ev.Fd == efdSlot {
				l.takePosted()
				continue
			}
			s := l.slots[ev.Fd]
			if s == nil {
				continue // ended earlier in this batch
			}
			switch {
			case ev.Pad == 1 && s.blocked && ev.Events&unix.EPOLLOUT != 0:
				l.write(s)
			case ev.Pad == 1 && ev.Events&(unix.EPOLLHUP|unix.EPOLLERR) != 0:
				l.end(s, clientHungUp)
			case ev.Pad == 1 && ev.Events&unix.EPOLLRDHUP != 0 && s.rdhup:
				l.clientClosed(s)
			case ev.Pad == 0 && !s.blocked:
				l.read(s, ev.Events)
			}
		}
		l.free = append(l.free, l.freed...)
		l.freed = l.freed[:0]
		if !l.armed.Equal(l.due) || !l.due.IsZero() && !time.Now().Before(l.due) {
			return true
		}
		if int(n) < len(l.events) && !l.again {
			return false
		}
		// More is ready: first let the goroutines waiting for the
		// processor run (run yields), as each stream's goroutine would have
		// after its event. A loop that served every ready event before
		// yielding held new requests back by whole waves of events.
		l.more = true
		return true
	}
}

// errNoLoop says the loop could not take a stream (its epoll set refused
// the sockets): the stream stays on its goroutine.
var errNoLoop = errors.New("relay loop: cannot watch the stream's sockets")

var clientHungUp = &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", unix.EPIPE)}

// post hands s to the loop.
func (l *relayLoop) post(s *loopStream) {
	l.mu.Lock()
	l.posted = append(l.posted, s)
	l.mu.Unlock()
	one := [8]byte{1}
	for {
		_, err := unix.Write(l.efd, one[:])
		if err != unix.EINTR {
			return // EAGAIN: the counter is full, the loop is woken anyway
		}
	}
}

// takePosted registers the streams posted since the last turn.
func (l *relayLoop) takePosted() {
	_, _, _ = unix.RawSyscall(unix.SYS_READ, uintptr(l.efd), uintptr(unsafe.Pointer(&l.efdBuf[0])), 8)
	l.mu.Lock()
	l.taken, l.posted = l.posted, l.taken[:0]
	l.mu.Unlock()
	now := time.Now()
	for i, s := range l.taken {
		l.taken[i] = nil
		var slot int32
		if k := len(l.free); k > 0 {
			slot, l.free = l.free[k-1], l.free[:k-1]
		} else {
			slot = int32(len(l.slots))
			l.slots = append(l.slots, nil)
		}
		s.slot, s.readAt, s.rdhup = slot, now, true
		up := unix.EpollEvent{Events: upEvents, Fd: slot}
		// The client's socket: its peer's close (the peer watch's job on
		// the goroutine path), hang-ups and errors, until it is written to.
		cl := unix.EpollEvent{Events: s.clientEvents(), Fd: slot, Pad: 1}
		if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, s.upFd, &up); err != nil {
			s.done <- errNoLoop
			l.free = append(l.free, slot)
			continue
		}
		if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, s.clFd, &cl); err != nil {
			_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, s.upFd, nil)
			s.done <- errNoLoop
			l.free = append(l.free, slot)
			continue
		}
		l.slots[slot] = s
		if s.idle > 0 {
			l.expect(now.Add(s.idle))
		}
	}
	l.taken = l.taken[:0]
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
func (l *relayLoop) read(s *loopStream, events uint32) {
	x := s.x
	rx := x.conn.rx
	room := x.buf[x.keep:]
	n, errno := rx.recvFd(uintptr(s.upFd), room)
	if errno == unix.EAGAIN {
		return
	}
	var err error
	switch {
	case errno != 0:
		err = &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("recvmsg", errno)}
	case n == 0:
		err = io.EOF
	default:
		x.conn.stamp()
		s.readAt = time.Now()
		if n == len(room) || events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			l.again = true
		}
	}
	rawFrom, out, last, data, serr := x.passScan(n)
	if serr != nil {
		err = serr
	}
	s.last, s.data, s.readErr, s.wrote = last, data, err, out > rawFrom
	s.pending = x.buf[rawFrom:out]
	l.write(s)
}

// write writes what is pending of the read being relayed; at a full
// socket buffer it stops reading the upstream and waits for the client's
// socket to be writable.
func (l *relayLoop) write(s *loopStream) {
	for len(s.pending) > 0 {
		n, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(s.clFd), uintptr(unsafe.Pointer(&s.pending[0])), uintptr(len(s.pending)))
		switch e {
		case 0:
			s.cc.sent += int64(n)
			s.pending = s.pending[n:]
			continue
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			if !s.blocked {
				s.blocked, s.since = true, time.Now()
				if s.wtime > 0 {
					l.expect(s.since.Add(s.wtime))
				}
				// The upstream is not read until the client takes pending:
				// only its hang-up, once (level-triggered, it would be
				// reported on every turn).
				l.interest(s, unix.EPOLLONESHOT)
			}
			return
		}
		s.x.readErr = s.readErr
		l.end(s, &net.OpError{Op: "write", Net: "tcp", Err: os.NewSyscallError("write", e)})
		return
	}
	if s.blocked {
		s.blocked, s.readAt = false, time.Now()
		s.cc.stall += s.readAt.Sub(s.since)
		l.interest(s, upEvents)
		if s.idle > 0 {
			l.expect(s.readAt.Add(s.idle))
		}
	}
	if end, err := s.x.passEnd(s.data, s.wrote, s.readErr, s.last); end {
		l.end(s, err)
	}
}

// interest sets what the loop waits for on s's upstream socket (up), and
// on its client socket what s's state says (clientEvents).
func (l *relayLoop) interest(s *loopStream, up uint32) {
	ev := unix.EpollEvent{Events: up, Fd: s.slot}
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_MOD, s.upFd, &ev)
	l.watchClient(s)
}

// watchClient sets what the loop waits for on s's client socket.
func (l *relayLoop) watchClient(s *loopStream) {
	ev := unix.EpollEvent{Events: s.clientEvents(), Fd: s.slot, Pad: 1}
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_MOD, s.clFd, &ev)
}

// clientClosed answers the client's socket reporting its peer's close
// (EPOLLRDHUP), as the peer watch answers a readable socket on the
// goroutine path: one look without consuming tells a client that left
// (nothing waiting) from one that sent more and then closed its side (bytes
// waiting, a pipelined request: closure cannot be told without reading, and
// the stream goes on). A client that left cancels the exchange as the watch
// would (cancelState.fire): the upstream socket is shut down, which ends
// the stream on this loop's next turn, recorded as a client cancel.
// Either way the close is not reported again.
func (l *relayLoop) clientClosed(s *loopStream) {
	state := peek(uintptr(s.clFd))
	s.rdhup = false
	l.watchClient(s)
	if state != peerData {
		s.x.fire()
	}
}

// clientEvents is what the loop waits for on s's client socket besides
// hang-ups and errors: writability while blocked, the peer's close while
// watched.
func (s *loopStream) clientEvents() uint32 {
	var ev uint32
	if s.blocked {
		ev |= unix.EPOLLOUT
	}
	if s.rdhup {
		ev |= unix.EPOLLRDHUP
	}
	return ev
}

// end takes s out of the loop and wakes its exchange with err.
func (l *relayLoop) end(s *loopStream, err error) {
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, s.upFd, nil)
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, s.clFd, nil)
	l.slots[s.slot] = nil
	l.freed = append(l.freed, s.slot)
	s.pending = nil
	s.done <- err
}

// scan ends the streams whose upstream was silent for their idle timeout
// or whose client did not take a write for the write timeout, and finds
// when the next timeout can fire.
func (l *relayLoop) scan(now time.Time) {
	l.due = time.Time{}
	for _, s := range l.slots {
		switch {
		case s == nil:
		case s.blocked && s.wtime > 0:
			if at := s.since.Add(s.wtime); now.After(at) {
				s.x.readErr = s.readErr
				l.end(s, &net.OpError{Op: "write", Net: "tcp", Err: os.ErrDeadlineExceeded})
			} else {
				l.expect(at)
			}
		case !s.blocked && s.idle > 0:
			if at := s.readAt.Add(s.idle); now.After(at) {
				err := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
				s.x.readErr = err
				l.end(s, err)
			} else {
				l.expect(at)
			}
		}
	}
}

// loopable reports whether a passChunks stream can move to a relay loop
// once nothing is buffered or framed by the server: not when the relay
// loops are off, on a connection that is not a plain socket with receive
// stamps, or for a compressed body (its side decoder could hold the loop
// up).
func (x *exchange) loopable() bool {
	cc, _ := x.client.(*clientConn)
	c := x.conn
	return !x.p.opts.GoroutineRelay && cc != nil && cc.raw != nil && c.rx != nil && c.rx.raw != nil &&
		c.up.tls == nil && x.dec == nil
}

// passLoop relays the rest of a passChunks stream on a relay loop, and
// reports false when it cannot (the stream then stays on its goroutine).
func (x *exchange) passLoop() (bool, error) {
	cc, c := x.client.(*clientConn), x.conn
	l := pickLoop()
	if l == nil {
		return false, nil
	}
	upFd, clFd := sockFd(c.rx.raw), sockFd(cc.raw)
	if upFd < 0 || clFd < 0 || !x.cancel.enterLoop() {
		return false, nil
	}
	if !cc.enterLoop() {
		x.cancel.leaveLoop()
		return false, nil
	}
	s := &x.loop
	if s.done == nil {
		s.done = make(chan error, 1)
	}
	s.x, s.cc, s.upFd, s.clFd = x, cc, upFd, clFd
	s.idle, s.wtime = c.timeout, cc.d
	// The loop watches the client's close itself (clientClosed): the peer
	// watch, its goroutine and its timers end here (most streams whose
	// first byte came within watchDelay never start it).
	x.watch.stop()
	l.post(s)
	err := <-s.done
	s.x, s.cc, s.readErr = nil, nil, nil
	cc.leaveLoop()
	x.cancel.leaveLoop()
	if err == errNoLoop {
		x.watch.start(x.client, x.fire)
		return false, nil
	}
	loopStreams.Add(1)
	return true, err
}

// sockFd returns the descriptor behind raw, or -1. Only a stream's own
// goroutine calls it, and the descriptor stays open while the stream is in
// a loop (see relayLoop).
func sockFd(raw syscall.RawConn) int {
	fd := -1
	if raw.Control(func(f uintptr) { fd = int(f) }) != nil {
		return -1
	}
	return fd
}

// shutdownConn shuts conn's socket down in both directions, which ends
// a relay loop's stream on it as a close would.
func shutdownConn(conn net.Conn) {
	if raw := rawConn(conn); raw != nil {
		_ = raw.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
	}
}
