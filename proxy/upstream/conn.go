package upstream

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

// Conn is one upstream connection. Its Read applies the current read
// timeout afresh on every call (time to first byte while waiting for the
// response, then the idle gap between chunks), so no timeout caps the
// length of a healthy stream, and it stamps the first byte of a response.
type Conn struct {
	net.Conn
	up *Backend
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

// Buffered is how many response bytes were read ahead and wait in the
// connection's reader (those that came with the response header).
func (c *Conn) Buffered() int { return c.br.Buffered() }

// ReadBuffered reads into b from what waits in the reader, before any
// read of the socket itself.
func (c *Conn) ReadBuffered(b []byte) (int, error) { return c.br.Read(b) }

// ByteWithin waits until a response body byte is in, for at most d (not
// the connection's idle timeout); false when none came.
func (c *Conn) ByteWithin(d time.Duration) bool {
	if c.br.Buffered() > 0 {
		return true
	}
	idle := c.timeout
	c.timeout = d
	_, err := c.br.Peek(1)
	c.timeout = idle
	return err == nil
}

// Idle is the longest gap allowed between two reads of the response.
func (c *Conn) Idle() time.Duration { return c.timeout }

// LastRead is when the kernel received the bytes of the last read (zero:
// not known).
func (c *Conn) LastRead() time.Time { return c.readAt }

// FirstByte is when the current response's first byte came (zero: none).
func (c *Conn) FirstByte() time.Time { return c.first }

// WasReused says the connection served a response before this request.
func (c *Conn) WasReused() bool { return c.reused }

// LimitHeaderWait shortens the wait for the response header below the
// upstream's first-byte timeout (a route's failover; 0: no limit).
func (c *Conn) LimitHeaderWait(d time.Duration) { c.headerLimit = d }

// Loopable says a relay loop can read the connection: a plain socket
// with receive stamps (not TLS, nor a test's pipe).
func (c *Conn) Loopable() bool { return c.rx != nil && c.rx.Raw() != nil && c.up.tls == nil }

// LoopFd returns the socket's descriptor for a relay loop, or -1 (not
// Loopable).
func (c *Conn) LoopFd() int {
	if !c.Loopable() {
		return -1
	}
	return sock.Fd(c.rx.Raw())
}

// RecvFd reads the socket for a relay loop that holds its descriptor fd
// (sock.Conn.RecvFd) and stamps the read (stamp) when bytes came.
func (c *Conn) RecvFd(fd int, b []byte) (int, syscall.Errno) {
	n, errno := c.rx.RecvFd(uintptr(fd), b)
	if errno == 0 && n > 0 {
		c.stamp()
	}
	return n, errno
}

// Reader is the connection's reader of responses (nil while a relay
// loop reads the socket: ParkReader).
func (c *Conn) Reader() *bufio.Reader { return c.br }

// Upstream connections' buffers: a reader per connection (8 KiB, held by
// every stream but those on a relay loop) and a writer per request written.
const (
	upReadBuffer  = 8 << 10
	upWriteBuffer = 4 << 10
)

// requestWriters holds the writers requests are written through
// (writeRequest).
var requestWriters = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, upWriteBuffer) }}

// ParkReader lets go of c's reader while a relay loop reads the socket
// (into spareReaders); only of an empty one (bytes read ahead stay where
// they are).
func (c *Conn) ParkReader() {
	if c.br == nil || c.br.Buffered() > 0 {
		return
	}
	c.br.Reset(nil)
	spareReaders.Put(c.br)
	c.br = nil
}

// UnparkReader gives c a reader again once its stream left the loop.
func (c *Conn) UnparkReader() {
	if c.br == nil {
		c.br = newUpReader(c)
	}
}

// WriteRequest writes what write puts in a pooled writer, then flushes
// it to the connection (counting the bytes sent on a plain one: see
// AckedBefore). Larger writes (long prompts) bypass the writer's buffer.
func (c *Conn) WriteRequest(write func(*bufio.Writer) error) error {
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
type sentCounter struct{ c *Conn }

func (w sentCounter) Write(p []byte) (int, error) {
	n, err := w.c.Conn.Write(p)
	w.c.sent += int64(n)
	return n, err
}

// AckedBefore returns how many bytes the backend's kernel had acknowledged
// before the next request is written, or -1 when unknown. On a plain
// connection that is every byte sent so far, without a syscall: the
// backend answered every earlier request in full, and each segment it sent
// acknowledged all it had received. Under TLS (records, handshakes) it is
// read from TCP_INFO.
func (c *Conn) AckedBefore() int64 {
	if c.up.tls == nil {
		if c.ackBase < 0 {
			return -1
		}
		return c.ackBase + c.sent
	}
	return c.BytesAcked()
}

func (c *Conn) Read(p []byte) (int, error) {
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
func (c *Conn) stamp() {
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
func (c *Conn) socket() net.Conn {
	if c.rx != nil {
		return c.rx
	}
	return c.Conn
}

// usable reports whether the connection may carry another request at now:
// within the pool's idle lifetime and what the backend's Keep-Alive header
// allowed.
func (c *Conn) usable(now time.Time) bool {
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
func (c *Conn) keepAlive(v []byte, end time.Time) {
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

// Send writes req on c and reads the response headers into resp, leaving
// the body as resp.BodyStream. It returns when the request was written.
func (c *Conn) Send(req *fasthttp.Request, resp *fasthttp.Response, head bool) (written time.Time, err error) {
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
	err = c.WriteRequest(req.Write)
	written = c.up.now()
	if err != nil {
		return written, fmt.Errorf("%w: %w", ErrWriteUpstream, err)
	}
	c.timeout = c.up.t.FirstByte
	if c.headerLimit > 0 {
		c.timeout = min(c.timeout, c.headerLimit)
	}
	c.armed = true
	resp.StreamBody = true
	resp.SkipBody = head
	if err = resp.Read(c.br); err != nil {
		return written, fmt.Errorf("%w: %w", ErrReadUpstream, err)
	}
	c.timeout = c.up.t.Idle
	if ka := resp.Header.Peek("Keep-Alive"); len(ka) > 0 {
		c.keepAlive(ka, c.up.now())
	}
	return written, nil
}

// BytesAcked returns how many bytes the peer's kernel acknowledged on the
// connection (TCP_INFO tcpi_bytes_acked), or -1 when it cannot be read. It
// does not allocate: the control function and the TCP_INFO buffer are the
// connection's own.
func (c *Conn) BytesAcked() int64 {
	if !c.ti.Read(sock.Raw(c.socket())) {
		return -1
	}
	return int64(c.ti.Info.Bytes_acked)
}

// peek checks once, without consuming a byte or allocating, whether the
// connection is still open and quiet.
func (c *Conn) peek() sock.PeerState {
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
