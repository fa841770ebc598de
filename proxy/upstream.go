package proxy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/valyala/fasthttp"
)

// upstream is one backend address with its own small pool of keep-alive
// connections.
//
// tokentap keeps this pool instead of using fasthttp.HostClient because a
// request must be abortable at any moment, above all while the backend is
// still prefilling and no response byte has arrived: HostClient.Do gives no
// handle on the connection it uses, so nothing could interrupt it. Here the
// exchange owns its connection, and closing it cancels the request at the
// backend. HTTP/1.1 framing still comes from fasthttp (Request.Write,
// Response.Read with StreamBody).
type upstream struct {
	scheme   string
	addr     string // host:port to dial
	host     string // Host header sent upstream
	basePath string // path prefix of the upstream URL, without trailing slash
	// auth is "Basic …" from the URL's user:password@, sent as this
	// upstream's Authorization instead of the client's ("": none). It is
	// never logged: errors and logs show the URL redacted (redactURL).
	auth   string
	tls    *tls.Config
	dialer net.Dialer
	t      Timeouts
	now    func() time.Time

	mu      sync.Mutex
	idle    []*upConn // LIFO: the longest idle first
	open    int       // connections open, idle or busy
	reaping bool      // a reap is scheduled (only while connections are idle)

	// afterStream is what the backend was seen to do with a connection
	// once a response of unknown length (a stream) ended on it: some
	// (llama.cpp's server) announce keep-alive and close it right after,
	// a race with the next request sent on it. Until it is known, such a
	// connection is reused only streamSettle after that end; once the
	// backend was seen to close one, they are closed instead of pooled;
	// once it was seen keeping streamKeptToTrust of them, they are pooled
	// as any other.
	afterStream atomic.Int32 // streamUnknown, streamCloses or streamKeeps
	streamsKept atomic.Int32
}

// What a backend does with a connection after a streamed response.
const (
	streamUnknown int32 = iota
	streamCloses
	streamKeeps
)

// streamSettle is how long after a streamed response a connection waits
// before reuse while the backend's habit is unknown: llama.cpp's server
// closes within a millisecond of the end (its FIN came 0.2–0.5 ms after
// the next request, sent within 0.5 ms of the end).
const streamSettle = 5 * time.Millisecond

// streamKeptToTrust is how many connections reused after a stream make a
// backend one that keeps them.
const streamKeptToTrust = 3

func newUpstream(rawURL string, t Timeouts, now func() time.Time) (*upstream, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, urlError(err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("scheme must be http or https, not %q", u.Scheme)
	}
	if u.Host == "" {
		return nil, errors.New("missing host")
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, errors.New("must not have a query or fragment")
	}
	up := &upstream{scheme: u.Scheme, host: u.Host, addr: u.Host, t: t, now: now}
	if u.User != nil {
		pass, _ := u.User.Password()
		up.auth = "Basic " + base64.StdEncoding.EncodeToString([]byte(u.User.Username()+":"+pass))
	}
	if u.Port() == "" {
		if u.Scheme == "https" {
			up.addr = net.JoinHostPort(u.Hostname(), "443")
		} else {
			up.addr = net.JoinHostPort(u.Hostname(), "80")
		}
	}
	up.basePath = trimSlash(u.EscapedPath())
	if u.Scheme == "https" {
		up.tls = &tls.Config{ServerName: u.Hostname(), MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
	}
	up.dialer = net.Dialer{Timeout: t.Connect, KeepAlive: 30 * time.Second,
		Control: func(_, _ string, raw syscall.RawConn) error {
			// Best effort: without stamps, reads are stamped when they return.
			_ = enableRxStamps(raw)
			return nil
		}}
	return up, nil
}

// redactURL is an upstream URL as errors and logs may show it: without
// its password, and without the text of a URL that does not parse (it
// could hold one).
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(an unparsable URL)"
	}
	return u.Redacted()
}

// urlError is err without the URL url.Parse quotes in it.
func urlError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

func trimSlash(s string) string {
	for len(s) > 0 && s[len(s)-1] == '/' {
		s = s[:len(s)-1]
	}
	return s
}

// upConn is one upstream connection. Its Read applies the current read
// timeout afresh on every call (time to first byte while waiting for the
// response, then the idle gap between chunks), so no timeout caps the
// length of a healthy stream, and it stamps the first byte of a response.
type upConn struct {
	net.Conn
	up *upstream
	br *bufio.Reader
	// headerLimit, when set, shortens the wait for the response header
	// below the upstream's first-byte timeout (a route's failover).
	headerLimit time.Duration
	bw          *bufio.Writer
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

	rx     *rxConn   // the TCP connection, for receive timestamps
	readAt time.Time // when the kernel received the bytes of the last read

	// Made once per connection, so that the checks before each reuse do
	// not allocate.
	peekFn  func(fd uintptr)
	peeked  peerState
	ti      tcpInfo
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
func (c *upConn) loopable() bool { return c.rx != nil && c.rx.raw != nil && c.up.tls == nil }

// loopFd returns the socket's descriptor for a relay loop, or -1 (not
// loopable).
func (c *upConn) loopFd() int {
	if !c.loopable() {
		return -1
	}
	return sockFd(c.rx.raw)
}

// recvFd reads the socket for a relay loop that holds its descriptor fd
// (rxConn.recvFd) and stamps the read (stamp) when bytes came.
func (c *upConn) recvFd(fd int, b []byte) (int, syscall.Errno) {
	n, errno := c.rx.recvFd(uintptr(fd), b)
	if errno == 0 && n > 0 {
		c.stamp()
	}
	return n, errno
}

// setDirect turns the relay loop's direct socket calls on or off.
func (c *upConn) setDirect(on bool) { setDirect(c.rx, on) }

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

// maxRxAge bounds how long bytes can have waited in an upstream socket for
// their receive timestamp to be believed (a guard against a stepped clock).
const maxRxAge = time.Minute

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
		c.readAt = received(c.rx.rx, c.readAt, maxRxAge)
	}
	if c.armed {
		c.armed = false
		c.first = c.readAt
	}
}

// get returns an idle connection that is still open and quiet, or dials a
// new one; fresh skips the pool.
//
// Every pooled connection is looked at before reuse (one non-consuming
// peek, no allocation): one the backend closed is replaced, and one with
// bytes waiting is closed unread. Such bytes can only be a response to no
// request (a backend that answered more than it was asked, or miscounted
// a body): read as the next request's response they would hand one user
// another's answer.
func (up *upstream) get(ctx context.Context, fresh bool) (*upConn, error) {
	now := up.now()
	up.mu.Lock()
	for !fresh && len(up.idle) > 0 {
		c := up.idle[len(up.idle)-1]
		up.idle = up.idle[:len(up.idle)-1]
		// The connection is this request's from here: the peek, a system
		// call, is made outside the lock the other requests wait on.
		up.mu.Unlock()
		state := peerUnknown
		if c.usable(now) {
			state = c.peek()
			if c.streamEnded {
				state = up.settle(c, state)
			}
		}
		if state == peerIdle {
			c.reused = true
			if c.usesLeft > 0 {
				c.usesLeft--
			}
			return c, nil
		}
		up.mu.Lock()
		up.open--
		up.mu.Unlock()
		switch state {
		case peerData:
			metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
		case peerClosed:
			metrics.UpstreamConnDiscarded(metrics.DiscardClosedByPeer)
		default:
			metrics.UpstreamConnDiscarded(metrics.DiscardExpired)
		}
		_ = c.Conn.Close()
		up.mu.Lock()
	}
	if up.t.MaxConns > 0 && up.open >= up.t.MaxConns {
		up.mu.Unlock()
		return nil, errTooManyConns
	}
	up.open++
	up.mu.Unlock()
	c, err := up.dial(ctx)
	if err != nil {
		up.mu.Lock()
		up.open--
		up.mu.Unlock()
		return nil, err
	}
	return c, nil
}

// settle looks at a connection whose last response was a stream while
// the backend's habit is unknown: it waits until streamSettle after that
// end for the backend's close, and learns from what it finds.
func (up *upstream) settle(c *upConn, state peerState) peerState {
	if state == peerIdle {
		if wait := streamSettle - up.now().Sub(c.lastUsed); wait > 0 {
			time.Sleep(wait)
			state = c.peek()
		}
	}
	switch state {
	case peerClosed:
		up.afterStream.CompareAndSwap(streamUnknown, streamCloses)
	case peerIdle:
		if up.streamsKept.Add(1) >= streamKeptToTrust {
			up.afterStream.CompareAndSwap(streamUnknown, streamKeeps)
		}
	}
	c.streamEnded = false
	return state
}

var (
	errTooManyConns  = errors.New("upstream connection limit reached")
	errWriteUpstream = errors.New("cannot write the request upstream")
	errReadUpstream  = errors.New("cannot read the upstream response")
)

func (up *upstream) dial(ctx context.Context) (*upConn, error) {
	conn, err := up.dialer.DialContext(ctx, "tcp", up.addr)
	if err != nil {
		return nil, err
	}
	var rx *rxConn
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
		rx = newRxConn(tc, true)
		conn = rx
	}
	if up.tls != nil {
		tc := tls.Client(conn, up.tls)
		hctx, cancel := context.WithTimeout(ctx, up.t.Connect)
		err = tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
		conn = tc
	}
	c := &upConn{Conn: conn, up: up, rx: rx, usesLeft: -1}
	// Held by every open stream: kept small. Larger writes (long prompts)
	// bypass the writer's buffer.
	c.br = bufio.NewReaderSize(c, 8<<10)
	if up.tls == nil {
		// Count what reaches the socket: see ackedBefore. The kernel's
		// count starts with the SYN; read it once, as the connection opens.
		c.bw = bufio.NewWriterSize(sentCounter{c}, 4<<10)
		c.ackBase = c.bytesAcked()
	} else {
		c.bw = bufio.NewWriterSize(conn, 4<<10)
	}
	return c, nil
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

// put returns a connection whose last response was read completely
// (streamed: a response of unknown length, ended by its framing). A
// connection with bytes read past the end of that response is closed
// instead: the response did not end at a message boundary; so is one after
// a stream from a backend that closes those (upstream.afterStream).
func (up *upstream) put(c *upConn, streamed bool) {
	if c.br.Buffered() > 0 {
		metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
		up.discard(c)
		return
	}
	c.streamEnded = false
	if streamed {
		switch up.afterStream.Load() {
		case streamCloses:
			metrics.UpstreamConnDiscarded(metrics.DiscardAfterStream)
			up.discard(c)
			return
		case streamUnknown:
			c.streamEnded = true
		}
	}
	if c.usesLeft == 0 {
		metrics.UpstreamConnDiscarded(metrics.DiscardExpired)
		up.discard(c)
		return
	}
	c.timeout = 0
	c.setFor = 0
	c.armed = false
	c.first = time.Time{}
	c.readAt = time.Time{}
	c.reused = false
	// The read deadline is left as it is: nothing reads an idle connection
	// (get peeks without it), and the next Read moves it (setFor is 0).
	c.lastUsed = up.now()
	up.mu.Lock()
	if len(up.idle) < up.t.MaxIdleConns {
		up.idle = append(up.idle, c)
		if !up.reaping && up.t.IdleConn > 0 {
			up.reaping = true
			time.AfterFunc(up.t.IdleConn, up.reap)
		}
		up.mu.Unlock()
		return
	}
	up.mu.Unlock()
	up.discard(c)
}

// reap closes the connections idle for longer than IdleConn, so that their
// descriptors, and the backend's, do not wait for the next request to be
// found expired. It is scheduled only while connections are idle: an idle
// proxy with an empty pool runs no timer.
func (up *upstream) reap() {
	now := up.now()
	up.mu.Lock()
	n := 0
	for n < len(up.idle) && now.Sub(up.idle[n].lastUsed) >= up.t.IdleConn {
		n++
	}
	expired := slices.Clone(up.idle[:n])
	up.idle = slices.Delete(up.idle, 0, n)
	up.open -= n
	if len(up.idle) > 0 {
		time.AfterFunc(up.idle[0].lastUsed.Add(up.t.IdleConn).Sub(now), up.reap)
	} else {
		up.reaping = false
	}
	up.mu.Unlock()
	for _, c := range expired {
		_ = c.Conn.Close()
	}
}

// discard closes a connection that must not be reused: its response was not
// read to the end, or the exchange was cancelled.
func (up *upstream) discard(c *upConn) {
	_ = c.Conn.Close()
	up.mu.Lock()
	up.open--
	up.mu.Unlock()
}

// closeIdle closes every idle connection.
func (up *upstream) closeIdle() {
	up.mu.Lock()
	idle := up.idle
	up.idle = nil
	up.open -= len(idle)
	up.mu.Unlock()
	for _, c := range idle {
		_ = c.Conn.Close()
	}
}

// smallRequest is the largest body written upstream without a write
// deadline (the kernel's default send buffer is 16 KiB, headers included).
const smallRequest = 8 << 10

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
	if err = req.Write(c.bw); err == nil {
		err = c.bw.Flush()
	}
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
	if !c.ti.read(rawConn(c.socket())) {
		return -1
	}
	return int64(c.ti.info.Bytes_acked)
}

// peek checks once, without consuming a byte or allocating, whether the
// connection is still open and quiet.
func (c *upConn) peek() peerState {
	raw := rawConn(c.socket())
	if raw == nil {
		return peerUnknown
	}
	if c.peekFn == nil {
		c.peekFn = func(fd uintptr) { c.peeked = peek(fd) }
	}
	c.peeked = peerUnknown
	_ = raw.Control(c.peekFn)
	return c.peeked
}
