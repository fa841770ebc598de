package relay

import (
	"io"
	"net"
	"os"

	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/relayplane"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"golang.org/x/sys/unix"
)

// The body relay's side of a relay loop (relayplane): what moves a
// passChunks stream into a loop, and the three methods through which the
// loop reads, writes and tells it the rest (looped).

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
func (r *Body) loopable() bool {
	cc, _ := r.client.(*downstream.Conn)
	return r.Server.Loops != nil && cc != nil && cc.Raw() != nil && r.up.Loopable() && !r.Meter.Decoding()
}

// passLoop moves the rest of a passChunks stream onto a relay loop, and
// reports false when it cannot (the stream then stays on its goroutine).
// Once it moved, the caller lets go of the exchange: the loop owns it, and
// as it lets go of the stream it starts the goroutine that carries it on
// (Ended). What the server had read ahead of the connection moves out of
// hj first (takeBuffered), so that the hijack's goroutine can return and
// the server's read buffer go with it: an open stream holds neither.
func (r *Body) passLoop(hj net.Conn) bool {
	cc, c := r.client.(*downstream.Conn), r.up
	l := r.Server.Loops.Pick()
	if l == nil {
		return false
	}
	upFd, clFd := c.LoopFd(), sock.Fd(cc.Raw())
	if upFd < 0 || clFd < 0 || !r.Cancel.EnterLoop() {
		return false
	}
	if !cc.EnterLoop() {
		r.Cancel.LeaveLoop()
		return false
	}
	if hj != nil {
		cc.TakeBuffered(hj, r.buf[r.keep:])
	}
	s := &r.loop
	s.S, s.UpFd, s.ClFd = (*looped)(r), upFd, clFd
	s.Idle, s.WriteTimeout = c.Idle(), cc.WriteTimeout()
	// The loop watches the client's close itself (clientClosed): the peer
	// watch, its goroutine and its timers end here (most streams whose
	// first byte came within watchDelay never start it); the socket's seat
	// in this loop's watch set is given up, as a socket is in an epoll set
	// once (the next request on the connection takes it again).
	r.Sink.Unwatch()
	cc.Seat().LeaveFor(l)
	// The upstream connection's reader is empty (passChunks moves only
	// then) and unused while the loop reads the socket: it is put aside
	// (parkReader) until the stream leaves the loop.
	c.ParkReader()
	if !l.Post(s) {
		r.leftLoop()
		r.Sink.Rewatch()
		return false
	}
	return true
}

// leftLoop undoes what passLoop did to move the stream.
func (r *Body) leftLoop() {
	r.loop.S, r.turn = nil, passTurn{}
	r.up.UnparkReader()
	r.client.(*downstream.Conn).LeaveLoop()
	r.Cancel.LeaveLoop()
}

// afterLoop carries the stream on, on a goroutine of its own, once the
// loop let go of it: there when the loop could not take it
// (relayplane.ErrNoLoop), then to its end (endPass). A relay that left
// without a read buffer takes one when it needs one again
// (relayplane.NewBuf).
func (r *Body) afterLoop(err error) {
	relayplane.GrowStack()
	r.leftLoop()
	if err == relayplane.ErrNoLoop {
		// The loop never took it: its read buffer is still its own.
		r.Sink.Rewatch()
		err = r.passRest()
	}
	if r.wait != nil {
		r.wait <- err
		return
	}
	r.endPass(nil, err)
}

// spareBuf gives the read buffer back to the loop between events, unless
// it holds a size line cut by the last read's end.
func (r *Body) spareBuf() {
	if r.keep == 0 && r.buf != nil {
		r.loop.GiveBuf(r.buf)
		r.buf = nil
	}
}

// looped is a body relay as its relay loop sees it (relayplane.Stream).
type looped Body

// Read reads the upstream socket once for the loop and scans what came
// (passScan).
func (l *looped) Read(fd int, events uint32) (out []byte, wait, got, again bool) {
	r := (*Body)(l)
	if r.buf == nil {
		r.buf = r.loop.TakeBuf()
	}
	room := r.buf[r.keep:]
	n, errno := r.up.RecvFd(fd, room)
	if errno == unix.EAGAIN {
		r.spareBuf()
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

// Written ends the read relayed once its bytes are written (passDone).
func (l *looped) Written() (bool, error) {
	r := (*Body)(l)
	end, err := r.passDone(r.turn.data, r.turn.wrote, r.turn.err, r.turn.last)
	if !end {
		r.spareBuf()
	}
	return end, err
}

// Note: the loop took the stream (the read buffer goes back to the loop
// until the next event: an open stream waiting for its backend holds
// none); bytes sent and stalls are counted on the client connection (a
// loop takes only streams to a clientConn: loopable); a client that left
// cancels the exchange; a failure keeps the upstream's error for the
// record; the end carries the stream on (afterLoop).
func (l *looped) Note(e relayplane.Event) {
	r := (*Body)(l)
	switch e.Kind {
	case relayplane.Entered:
		r.spareBuf()
	case relayplane.Sent:
		r.client.(*downstream.Conn).Sent += int64(e.N)
	case relayplane.Stalled:
		r.client.(*downstream.Conn).Stall += e.D
	case relayplane.ClientLeft:
		r.Sink.ClientLeft()
	case relayplane.Failed:
		err := e.Err
		if e.KeepRead {
			err = r.turn.err
		}
		r.readErr = err
	case relayplane.Ended:
		go r.afterLoop(e.Err)
	}
}
