package downstream

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/relayplane"
	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// Watch detects a client that closed its connection while tokentap
// still waits on the upstream, without consuming any byte of the client's.
// fasthttp reports a gone client only on the second write after the close,
// which never comes during a long prefill or a long silence.
//
// A goroutine parks in the netpoller until the client socket becomes
// readable, then peeks: a zero-byte read or an error means the client left,
// and gone is called. Bytes waiting (a pipelined request) end the watch
// without calling gone, since closure can no longer be seen without reading.
//
// While the proxy's relay loops run, a loop watches the socket instead
// (the watch is its Watched): from the start, for its peer's close alone
// (EPOLLRDHUP), with no goroutine, timer or deadline per request. A client
// connection's socket sits in a loop's epoll set from its first request
// until it closes (its relayplane.Seat), so that a kept-alive
// connection's later watches make no system call; another socket is
// registered for its request alone (relayplane.Loop.Watch). The goroutine
// watch is for a proxy without loops (relay: goroutine).
//
// A Watch lives in a pooled exchange and serves one request after
// another: its timer and channel are made once.
type Watch struct {
	loop    *relayplane.Loop // the loop watching the socket, while one does
	slot    int32            // its slot there
	seat    *relayplane.Seat // or the seat it watches from, while it does
	conn    net.Conn
	raw     syscall.RawConn
	gone    func()
	done    chan struct{} // the watch goroutine's end, one value per run
	timer   *time.Timer
	active  bool // started and not yet stopped (owner goroutine only)
	stopped atomic.Bool
	state   sock.PeerState
	peekFn  func(fd uintptr) bool
	// after stops the watch of an HTTP/2 stream's context (its reset, or
	// its connection's end), which sends on afterDone once gone returned.
	after     func() bool
	afterDone chan struct{}
	// tls: a TLS connection, whose waiting bytes may be the close_notify
	// alert a leaving client sends before its FIN: they do not end the
	// watch, only the peer's shutdown (POLLRDHUP) or reset does.
	tls bool
}

// watchDelay is how long a request runs before its client is watched: most
// short requests (embeddings, cached or tiny completions) end before, and
// skip the goroutine, its timers and its syscall. A client leaving is then
// noticed at most this much later, against prefills of hundreds of ms.
const watchDelay = 10 * time.Millisecond

// Start watches conn: on one of loops when one runs and takes it, else
// from watchDelay on, on a goroutine; nothing happens when conn is not a
// socket. gone is called at most once, from the loop or the watch
// goroutine. Every start must be followed by a stop before the next.
func (w *Watch) Start(conn net.Conn, gone func(), loops *relayplane.Set) {
	if s, ok := conn.(*Stream); ok {
		w.startStream(s, gone)
		return
	}
	raw := sock.Raw(conn)
	if raw == nil {
		return
	}
	w.conn, w.raw, w.gone = conn, raw, gone
	_, w.tls = conn.(*TLSConn)
	w.stopped.Store(false)
	w.active = true
	if cc := Of(conn); cc != nil {
		if cc.seat.Watch(loops, w) {
			w.seat = &cc.seat
			return
		}
	} else if l := loops.Pick(); l != nil {
		if slot, ok := l.Watch(w); ok {
			w.loop, w.slot = l, slot
			return
		}
	}
	if w.timer == nil {
		w.done = make(chan struct{}, 1)
		w.peekFn = w.peekOnce
		w.timer = time.AfterFunc(watchDelay, w.run)
		return
	}
	w.timer.Reset(watchDelay)
}

func (w *Watch) run() {
	defer func() { w.done <- struct{}{} }()
	// The server's read deadline for the request (ReadTimeout) is still
	// set; left alone it would end the watch minutes into a long stream.
	// stop marks the watch stopped before it moves the deadline into the
	// past, so either that deadline comes after this one, or stopped is
	// seen below.
	if w.conn.SetReadDeadline(time.Time{}) != nil || w.stopped.Load() {
		return
	}
	w.state = sock.PeerIdle
	// Read calls the function again each time the socket becomes readable
	// for as long as it returns false; a read deadline in the past ends it.
	err := w.raw.Read(w.peekFn)
	if err == nil && w.state == sock.PeerClosed {
		w.gone()
	}
}

func (w *Watch) peekOnce(fd uintptr) bool {
	w.state = sock.Peek(fd)
	if w.state == sock.PeerData && w.tls {
		if !sock.HungUp(fd) {
			w.state = sock.PeerIdle
			return false // wait for the next bytes or the FIN
		}
		w.state = sock.PeerClosed
	}
	return w.state != sock.PeerIdle
}

// Look is the loop watch's look at a socket that reported its
// peer's close or a hang-up: whether the watch ends, and whether the
// client is gone. Bytes waiting on a plain connection end it without a
// verdict (a pipelined request: closure cannot be told without reading);
// on TLS they may be the close_notify alert a leaving client sends before
// its FIN, so the close decides. Nothing waiting and no close (a stale
// report) leaves the socket watched.
func (w *Watch) Look() (end, gone bool) {
	state := sock.PeerUnknown
	if w.raw.Control(func(fd uintptr) { state = sock.Peek(fd) }) != nil {
		return true, false // closed under the watch: its owner knows
	}
	switch state {
	case sock.PeerIdle:
		return false, false
	case sock.PeerClosed:
		return true, true
	case sock.PeerData:
		return true, w.tls
	}
	return true, false
}

// Stop ends the watch and waits for its goroutine, leaving conn with no
// read deadline when the watch ran. It must be called before the server
// reads from conn again; calls after the first do nothing.
func (w *Watch) Stop() {
	if !w.active {
		return
	}
	w.active = false
	w.stopped.Store(true)
	if w.after != nil {
		if !w.after() {
			<-w.afterDone // gone is running: wait for it
		}
		w.after = nil
		w.release()
		return
	}
	if w.seat != nil {
		w.seat.Unwatch(w)
		w.seat = nil
		w.release()
		return
	}
	if w.loop != nil {
		w.loop.Unwatch(w.slot, w)
		w.loop = nil
		w.release()
		return
	}
	if w.timer.Stop() {
		w.release()
		return // the watch never started
	}
	select {
	case <-w.done:
	default:
		_ = w.conn.SetReadDeadline(aLongTimeAgo)
		<-w.done
	}
	_ = w.conn.SetReadDeadline(time.Time{})
	w.release()
}

// Control runs f with the watched socket's descriptor (the loop's look at
// it); Gone tells that the client left.
func (w *Watch) Control(f func(fd uintptr)) error { return w.raw.Control(f) }

// Gone: see Control.
func (w *Watch) Gone() { w.gone() }

// Kept is the watch's next life in a pooled exchange: its timer and
// channel, nothing watched.
func (w *Watch) Kept() Watch {
	return Watch{done: w.done, timer: w.timer, peekFn: w.peekFn, afterDone: w.afterDone}
}

// startStream watches an HTTP/2 stream: its context ends when the client
// resets the stream (RST_STREAM) or the connection ends, the cancel of a
// client that left.
func (w *Watch) startStream(s *Stream, gone func()) {
	if w.afterDone == nil {
		w.afterDone = make(chan struct{}, 1)
	}
	w.gone = gone
	w.stopped.Store(false)
	w.active = true
	w.after = context.AfterFunc(s.Context(), func() {
		w.gone()
		w.afterDone <- struct{}{}
	})
}

// release drops the request's references; the timer and channel stay.
func (w *Watch) release() { w.conn, w.raw, w.gone = nil, nil, nil }

var aLongTimeAgo = time.Unix(1, 0)
