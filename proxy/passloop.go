package proxy

import (
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The body relay's side of a relay loop (loop.go): what moves a passChunks
// stream into a loop, and the relayed methods through which the loop
// reads, writes and ends it.

// passTurn is the read a relay loop is relaying: the end of the bytes
// read in the relay's buffer, the data bytes found, whether anything is
// to be written, and the read's error.
type passTurn struct {
	last  int
	data  int
	wrote bool
	err   error
}

// loopable reports whether a passChunks stream can move to a relay loop
// once its header is out and nothing is buffered: not when the relay
// loops are off, on a connection that is not a plain socket with receive
// stamps, or for a compressed body (its side decoder could hold the loop
// up).
func (r *bodyRelay) loopable() bool {
	cc, _ := r.x.client.(*clientConn)
	return !r.x.p.opts.GoroutineRelay && cc != nil && cc.raw != nil && r.x.att.conn.loopable() && r.x.tap.dec == nil
}

// passLoop relays the rest of a passChunks stream on a relay loop, and
// reports false when it cannot (the stream then stays on its goroutine).
func (r *bodyRelay) passLoop() (bool, error) {
	cc, c := r.x.client.(*clientConn), r.x.att.conn
	l := r.x.p.loops.pick()
	if l == nil {
		return false, nil
	}
	upFd, clFd := c.loopFd(), sockFd(cc.raw)
	if upFd < 0 || clFd < 0 || !r.x.cancel.enterLoop() {
		return false, nil
	}
	if !cc.enterLoop() {
		r.x.cancel.leaveLoop()
		return false, nil
	}
	s := &r.loop
	if s.done == nil {
		s.done = make(chan error, 1)
	}
	s.r, s.upFd, s.clFd = r, upFd, clFd
	s.idle, s.wtime = c.idle(), cc.d
	// The loop watches the client's close itself (clientClosed): the peer
	// watch, its goroutine and its timers end here (most streams whose
	// first byte came within watchDelay never start it).
	r.x.watch.stop()
	err := errNoLoop
	if l.post(s) {
		err = <-s.done
	}
	s.r, r.turn = nil, passTurn{}
	cc.leaveLoop()
	r.x.cancel.leaveLoop()
	if err == errNoLoop {
		r.x.watch.start(r.x.client, r.x.fire)
		return false, nil
	}
	loopStreams.Add(1)
	return true, err
}

// relayRead reads the upstream socket once for the loop and scans what
// came (passScan).
func (r *bodyRelay) relayRead(fd int, events uint32) (out []byte, wait, got, again bool) {
	room := r.buf[r.keep:]
	n, errno := r.x.att.conn.recvFd(fd, room)
	if errno == unix.EAGAIN {
		return nil, true, false, false
	}
	var err error
	switch {
	case errno != 0:
		err = &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("recvmsg", errno)}
	case n == 0:
		err = io.EOF
	default:
		got = true
		again = n == len(room) || events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0
	}
	end, last, data, serr := r.passScan(n)
	if serr != nil {
		err = serr
	}
	r.turn = passTurn{last: last, data: data, wrote: end > 0, err: err}
	return r.buf[:end], false, got, again
}

// relayWritten ends the read relayed once its bytes are written (passDone).
func (r *bodyRelay) relayWritten() (bool, error) {
	return r.passDone(r.turn.data, r.turn.wrote, r.turn.err, r.turn.last)
}

// relayFailed keeps the upstream's error for the record.
func (r *bodyRelay) relayFailed(err error, keepRead bool) {
	if keepRead {
		err = r.turn.err
	}
	r.readErr = err
}

// relaySent and relayStalled count on the client connection (a loop
// takes only streams to a clientConn: loopable).
func (r *bodyRelay) relaySent(n int) { r.x.client.(*clientConn).sent += int64(n) }

func (r *bodyRelay) relayStalled(d time.Duration) { r.x.client.(*clientConn).stall += d }

func (r *bodyRelay) relayCancel() { r.x.fire() }

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
