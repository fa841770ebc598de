package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/valyala/fasthttp"
)

// upConn is one upstream connection. Its Read applies the current read
// timeout afresh on every call (time to first byte while waiting for the
// response, then the idle gap between chunks), so no timeout caps the
// length of a healthy stream, and it stamps the first byte of a response.
type upConn struct {
	net.Conn
	up *upstream
	// br reads the responses; nil while a relay loop reads the socket
	// (parkReader). Requests are written through a pooled writer
	// (writeRequest): a connection holds none while it waits or streams.
	br *bufio.Reader
	// headerLimit, when set, shortens the wait for the response header
	// below the upstream's first-byte timeout (a route's failover).
	headerLimit time.Duration
	timeout     time.Duration
	setAt       time.Time     // when the read deadline was last moved
	setFor      time.Duration // the timeout it was moved for
	armed       bool          // waiting for the first response byte
	first       time.Time     // when it came
	lastUsed    time.Time
	reused      bool

	// What the backend allows of this connection, from its Keep-Alive
	// response header: requests left (-1: no limit) and the time it may
	// close the connection by (zero: no limit).
	usesLeft  int
	keepUntil time.Time
	// streamEnded: the last response on it was a stream, which ended at
	// lastUsed (see upstream.afterStream).
	streamEnded bool

	writeDeadline bool // a write deadline is set (large requests only)

	rx     *sock.Conn // the TCP connection, for receive timestamps
	readAt time.Time  // when the kernel received the bytes of the last read

	// Made once per connection, so that the checks before each reuse do
	// not allocate.
	peekFn  func(fd uintptr)
	peeked  sock.PeerState
	ti      sock.TCPInfo
	sent    int64 // bytes written to the socket (plain connections only)
	ackBase int64 // the kernel's acknowledged count when the connection opened
}

// buffered is how many response bytes were read ahead and wait in the
// connection's reader (those that came with the response header).
func (c *upConn) buffered() int { return c.br.Buffered() }

// readBuffered reads into b from what waits in the reader, before any
// read of the socket itself.
func (c *upConn) readBuffered(b []byte) (int, error) { return c.br.Read(b) }

// byteWithin waits until a response body byte is in, for at most d (not
// the connection's idle timeout); false when none came.
func (c *upConn) byteWithin(d time.Duration) bool {
	if c.br.Buffered() > 0 {
		return true
	}
	idle := c.timeout
	c.timeout = d
	_, err := c.br.Peek(1)
	c.timeout = idle
	return err == nil
}

// idle is the longest gap allowed between two reads of the response.
func (c *upConn) idle() time.Duration { return c.timeout }

// lastRead is when the kernel received the bytes of the last read (zero:
// not known).
func (c *upConn) lastRead() time.Time { return c.readAt }

// firstByte is when the current response's first byte came (zero: none).
func (c *upConn) firstByte() time.Time { return c.first }

// wasReused says the connection served a response before this request.
func (c *upConn) wasReused() bool { return c.reused }

// limitHeaderWait shortens the wait for the response header below the
// upstream's first-byte timeout (a route's failover; 0: no limit).
func (c *upConn) limitHeaderWait(d time.Duration) { c.headerLimit = d }

// loopable says a relay loop can read the connection: a plain socket
// with receive stamps (not TLS, nor a test's pipe).
func (c *upConn) loopable() bool { return c.rx != nil && c.rx.Raw() != nil && c.up.tls == nil }

// loopFd returns the socket's descriptor for a relay loop, or -1 (not
// loopable).
func (c *upConn) loopFd() int {
	if !c.loopable() {
		return -1
	}
	return sock.Fd(c.rx.Raw())
}

// recvFd reads the socket for a relay loop that holds its descriptor fd
// (sock.Conn.RecvFd) and stamps the read (stamp) when bytes came.
func (c *upConn) recvFd(fd int, b []byte) (int, syscall.Errno) {
	n, errno := c.rx.RecvFd(uintptr(fd), b)
	if errno == 0 && n > 0 {
		c.stamp()
	}
	return n, errno
}

// Upstream connections' buffers: a reader per connection (8 KiB, held by
// every stream but those on a relay loop) and a writer per request written.
const (
	upReadBuffer  = 8 << 10
	upWriteBuffer = 4 << 10
)

// requestWriters holds the writers requests are written through
// (writeRequest).
var requestWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, upWriteBuffer) }}

// parkReader lets go of c's reader while a relay loop reads the socket
// (into spareReaders); only of an empty one (bytes read ahead stay where
// they are).
func (c *upConn) parkReader() {
	if c.br == nil || c.br.Buffered() > 0 {
		return
	}
	c.br.Reset(nil)
	spareReaders.Put(c.br)
	c.br = nil
}

// unparkReader gives c a reader again once its stream left the loop.
func (c *upConn) unparkReader() {
	if c.br == nil {
		c.br = newUpReader(c)
	}
}

// writeRequest writes what write puts in a pooled writer, then flushes
// it to the connection (counting the bytes sent on a plain one: see
// ackedBefore). Larger writes (long prompts) bypass the writer's buffer.
func (c *upConn) writeRequest(write func(*bufio.Writer) error) error {
	w := requestWriters.Get().(*bufio.Writer)
	if c.up.tls != nil {
		w.Reset(c.Conn)
	} else {
		w.Reset(sentCounter{c})
	}
	err := write(w)
	if err == nil {
		err = w.Flush()
	}
	w.Reset(nil)
	requestWriters.Put(w)
	return err
}

// sentCounter counts the bytes written to a plain upstream connection.
type sentCounter struct{ c *upConn }

func (w sentCounter) Write(p []byte) (int, error) {
	n, err := w.c.Conn.Write(p)
	w.c.sent += int64(n)
	return n, err
}

// ackedBefore returns how many bytes the backend's kernel had acknowledged
// before the next request is written, or -1 when unknown. On a plain
// connection that is every byte sent so far, without a syscall: the
// backend answered every earlier request in full, and each segment it sent
// acknowledged all it had received. Under TLS (records, handshakes) it is
// read from TCP_INFO.
func (c *upConn) ackedBefore() int64 {
	if c.up.tls == nil {
		if c.ackBase < 0 {
			return -1
		}
		return c.ackBase + c.sent
	}
	return c.bytesAcked()
}

func (c *upConn) Read(p []byte) (int, error) {
	if c.timeout > 0 {
		// Moving a deadline costs; reads in a quick burst share one, which
		// shortens the timeout by at most 1%.
		if now := c.up.now(); c.setFor != c.timeout || now.Sub(c.setAt) > c.timeout/100 {
			if err := c.Conn.SetReadDeadline(now.Add(c.timeout)); err != nil {
				return 0, err
			}
			c.setAt, c.setFor = now, c.timeout
		}
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.stamp()
	}
	return n, err
}

// stamp notes when the bytes of the read just made arrived (readAt), and
// the response's first byte.
func (c *upConn) stamp() {
	c.readAt = c.up.now()
	if c.rx != nil {
		c.readAt = sock.Received(c.rx.Rx(), c.readAt, maxRxAge)
	}
	if c.armed {
		c.armed = false
		c.first = c.readAt
	}
}

// socket returns the TCP connection under c (under TLS, if any).
func (c *upConn) socket() net.Conn {
	if c.rx != nil {
		return c.rx
	}
	return c.Conn
}

// usable reports whether the connection may carry another request at now:
// within the pool's idle lifetime and what the backend's Keep-Alive header
// allowed.
func (c *upConn) usable(now time.Time) bool {
	if c.up.t.IdleConn > 0 && now.Sub(c.lastUsed) >= c.up.t.IdleConn {
		return false
	}
	if !c.keepUntil.IsZero() && !now.Before(c.keepUntil) {
		return false
	}
	return c.usesLeft != 0
}

// keepAlive reads the backend's Keep-Alive response header (RFC 2068
// §19.7.1.1, as Apache, llama.cpp's server and others send it):
// "timeout=N" is how long the backend keeps an idle connection, "max=N"
// how many more requests it accepts on it. The connection is not reused
// past either; a second of margin keeps tokentap from sending a request as
// the backend closes.
func (c *upConn) keepAlive(v []byte, end time.Time) {
	for len(v) > 0 {
		var tok []byte
		if i := bytes.IndexByte(v, ','); i >= 0 {
			tok, v = v[:i], v[i+1:]
		} else {
			tok, v = v, nil
		}
		k, val, ok := bytes.Cut(bytes.TrimSpace(tok), []byte{'='})
		if !ok {
			continue
		}
		n, err := strconv.Atoi(string(bytes.Trim(bytes.TrimSpace(val), `"`)))
		if err != nil || n < 0 {
			continue
		}
		switch {
		case bytes.EqualFold(bytes.TrimSpace(k), []byte("timeout")):
			d := time.Duration(n) * time.Second
			c.keepUntil = end.Add(d - min(time.Second, d/2))
		case bytes.EqualFold(bytes.TrimSpace(k), []byte("max")):
			c.usesLeft = n
		}
	}
}

// send writes req on c and reads the response headers into resp, leaving
// the body as resp.BodyStream. It returns when the request was written.
func (c *upConn) send(req *fasthttp.Request, resp *fasthttp.Response, head bool) (written time.Time, err error) {
	switch {
	case c.up.t.Write > 0 && len(req.Body()) > smallRequest:
		_ = c.Conn.SetWriteDeadline(c.up.now().Add(c.up.t.Write))
		c.writeDeadline = true
	case c.writeDeadline:
		// Cleared once, not moved per request: a small request on a
		// connection with nothing in flight fits in the socket's send
		// buffer, so its write cannot block.
		_ = c.Conn.SetWriteDeadline(time.Time{})
		c.writeDeadline = false
	}
	err = c.writeRequest(req.Write)
	written = c.up.now()
	if err != nil {
		return written, fmt.Errorf("%w: %w", errWriteUpstream, err)
	}
	c.timeout = c.up.t.FirstByte
	if c.headerLimit > 0 {
		c.timeout = min(c.timeout, c.headerLimit)
	}
	c.armed = true
	resp.StreamBody = true
	resp.SkipBody = head
	if err = resp.Read(c.br); err != nil {
		return written, fmt.Errorf("%w: %w", errReadUpstream, err)
	}
	c.timeout = c.up.t.Idle
	if ka := resp.Header.Peek("Keep-Alive"); len(ka) > 0 {
		c.keepAlive(ka, c.up.now())
	}
	return written, nil
}

// bytesAcked returns how many bytes the peer's kernel acknowledged on the
// connection (TCP_INFO tcpi_bytes_acked), or -1 when it cannot be read. It
// does not allocate: the control function and the TCP_INFO buffer are the
// connection's own.
func (c *upConn) bytesAcked() int64 {
	if !c.ti.Read(sock.Raw(c.socket())) {
		return -1
	}
	return int64(c.ti.Info.Bytes_acked)
}

// peek checks once, without consuming a byte or allocating, whether the
// connection is still open and quiet.
func (c *upConn) peek() sock.PeerState {
	raw := sock.Raw(c.socket())
	if raw == nil {
		return sock.PeerUnknown
	}
	if c.peekFn == nil {
		c.peekFn = func(fd uintptr) { c.peeked = sock.Peek(fd) }
	}
	c.peeked = sock.PeerUnknown
	_ = raw.Control(c.peekFn)
	return c.peeked
}
