package downstream

import (
	"bytes"
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/valyala/fasthttp"
)

// HTTP/2 on the client's side.
//
// Every connection is accepted and first read by the server (fasthttp),
// which speaks HTTP/1.x alone. A connection that speaks HTTP/2 says so
// before its first request: over TLS its handshake chose "h2" (ALPN), in
// plain text its first bytes are HTTP/2's connection preface (h2c with
// prior knowledge). The Conn sees it on its first read and answers that
// read with h2Marker, a request the server parses whole without another
// read, and keeps what it read for later reads. The request handler
// sees H2 on the connection, takes it over with no response (a hijack),
// and hands it to H2.ServeConn, where net/http's HTTP/2 server (the Go
// team's, once golang.org/x/net/http2) speaks the protocol: frames,
// HPACK, flow control, the limits on streams, headers and resets. Each
// stream becomes a fasthttp.RequestCtx on a Stream and goes through the
// same handler as an HTTP/1.1 request: one request path, which knows of
// the protocol below only that its connection is a Stream.
//
// HTTP/1.1 connections pay one comparison on their first read.

// h2Preface is what an HTTP/2 client sends first (RFC 9113, 3.4).
const h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// h2Marker is what the server reads of an HTTP/2 connection: a complete
// request, never served (the handler checks H2 first).
const h2Marker = "OPTIONS * HTTP/1.1\r\nHost: h2\r\n\r\n"

// Protocol names, as records and metrics carry them.
const (
	ProtoHTTP1 = "HTTP/1.1"
	ProtoHTTP2 = "HTTP/2"
)

// What a Conn has learned of its protocol.
const (
	protoUnknown uint8 = iota // no byte read yet
	protoHTTP1
	protoH2
)

// H2 reports that the connection speaks HTTP/2: its handler gives it to
// H2.ServeConn.
func (c *Conn) H2() bool { return c.proto == protoH2 }

// sniffH2 follows the first read of a connection (n bytes in b, and
// err), which began as HTTP/2's preface does: it reads on until the
// preface is whole, or the bytes differ from it. An HTTP/2 connection's
// reads then return h2Marker and the bytes read; another's the bytes as
// they came, its request header scanned.
func (c *Conn) sniffH2(b []byte, n int, err error, src io.Reader) (int, error) {
	got := append([]byte(nil), b[:n]...)
	for err == nil && len(got) < len(h2Preface) && prefaceStart(got) {
		n, err = src.Read(b)
		got = append(got, b[:n]...)
	}
	if len(got) >= len(h2Preface) && string(got[:len(h2Preface)]) == h2Preface {
		c.toH2(got)
	} else {
		if c.inHead {
			c.scanHead(got)
		}
		c.pending = got
	}
	n = copy(b, c.pending)
	if c.pending = c.pending[n:]; len(c.pending) == 0 {
		c.pending = nil
		return n, err
	}
	return n, nil // err comes again on the read after the pending bytes
}

// prefaceStart reports whether b (a first read) begins as HTTP/2's
// preface does, or is the start of it.
func prefaceStart(b []byte) bool {
	k := min(len(b), len(h2Preface))
	return k > 0 && string(b[:k]) == h2Preface[:k]
}

// toH2 makes the connection an HTTP/2 one whose bytes read so far are
// got: the server reads h2Marker, the HTTP/2 server the rest.
func (c *Conn) toH2(got []byte) {
	c.proto = protoH2
	c.inHead = false
	c.pending = append(append(make([]byte, 0, len(h2Marker)+len(got)), h2Marker...), got...)
}

// A Stream is one HTTP/2 stream as the request path sees its connection:
// the net.Conn of its fasthttp.RequestCtx. It is not written or read
// through (the stream's body is the RequestCtx's, its response written
// by H2); it carries the stream's context, which ends when the client
// resets the stream or the connection closes (the peer watch's signal:
// Watch.Start), and the connection's addresses.
type Stream struct {
	conn net.Conn
	cc   *Conn // the connection tokentap accepted, under the TLS layer and the hijack (nil: another)
	ctx  context.Context
	// counts is what the stream's writes counted (measure.StreamCounts):
	// each write (and its flush) that took longer than stallMin counts
	// whole in Stall, its wait being the stream's flow-control window
	// (the client's application had not taken the bytes before: HTTP/2
	// says so, where HTTP/1.1 does not) or the connection's socket; Sent
	// is the connection's count at the end of the socket write that
	// carried them. Owner: the stream's handler goroutine.
	counts measure.StreamCounts
}

// Counts are the stream's counts of its delivery (see Stream.counts).
func (s *Stream) Counts() *measure.StreamCounts { return &s.counts }

// ConnSent is the connection's count of bytes written when the stream
// began, to tell a connection's first response from later ones.
func (s *Stream) ConnSent() int64 {
	if s.cc == nil {
		return 0
	}
	return s.cc.h2w.sentSoFar()
}

// Conn is the connection tokentap accepted that carries the stream (nil:
// another).
func (s *Stream) Conn() *Conn { return s.cc }

// Arrival is when the stream's request reached the kernel: the receive
// time of the connection's last read when its handler started (the read
// that brought its HEADERS frame, or one just after it: the reads of a
// connection come on the HTTP/2 server's own goroutine, the handler on
// a goroutine started for the stream), or now (see sock.Received).
func (s *Stream) Arrival(now time.Time, maxAge time.Duration) time.Time {
	if s.cc == nil {
		return now
	}
	return sock.Received(s.cc.h2w.rx.Load(), now, maxAge)
}

func (s *Stream) Read([]byte) (int, error)         { return 0, io.EOF }
func (s *Stream) Write([]byte) (int, error)        { return 0, http.ErrNotSupported }
func (s *Stream) Close() error                     { return nil }
func (s *Stream) LocalAddr() net.Addr              { return s.conn.LocalAddr() }
func (s *Stream) RemoteAddr() net.Addr             { return s.conn.RemoteAddr() }
func (s *Stream) SetDeadline(time.Time) error      { return nil }
func (s *Stream) SetReadDeadline(time.Time) error  { return nil }
func (s *Stream) SetWriteDeadline(time.Time) error { return nil }

// Context is the stream's: done when the client reset the stream or the
// connection ended.
func (s *Stream) Context() context.Context { return s.ctx }

// Protocol names the protocol c's requests came over.
func Protocol(c net.Conn) string {
	if _, ok := c.(*Stream); ok {
		return ProtoHTTP2
	}
	return ProtoHTTP1
}

// H2Options are the HTTP/2 server's limits.
type H2Options struct {
	// MaxStreams is the streams a client may have open at once on one
	// connection (SETTINGS_MAX_CONCURRENT_STREAMS; nginx's default 128).
	MaxStreams uint32
	// MaxHeaderBytes bounds a request's header list (as HTTP/1.1's
	// header is bounded by the server's read buffer).
	MaxHeaderBytes int
	// IdleTimeout closes a connection with no open stream.
	IdleTimeout time.Duration
	// WriteTimeout is how long one write of a response may wait for the
	// client's flow-control window and socket (a sliding deadline, as
	// HTTP/1.1 connections have).
	WriteTimeout time.Duration
	// ErrorLog gets the HTTP/2 server's own messages.
	ErrorLog *log.Logger
	// CountError counts the protocol errors the server answered, by
	// their kind (net/http's names: lower case, digits and _).
	CountError func(kind string)
}

// H2 serves HTTP/2 connections: each stream a RequestCtx given to
// handler, its response written back as the stream's. The protocol is
// net/http's server (which holds Go's HTTP/2, x/net's server moved into
// the standard library), asked for HTTP/2 with prior knowledge alone: the
// connections it is given have shown their preface, or are TLS
// connections whose handshake chose h2, their plain text read here.
type H2 struct {
	srv     http.Server
	handler fasthttp.RequestHandler
	write   time.Duration
	streams sync.Pool // *h2Stream

	start  sync.Once
	conns  chan net.Conn // handed over by ServeConn, taken by srv's Accept
	closed chan struct{}
	shut   sync.Once
}

// connKey finds a stream's connection in its context.
type connKey struct{}

// h2Stream is what serving one stream takes, pooled.
type h2Stream struct {
	conn Stream
	ctx  fasthttp.RequestCtx
}

// NewH2 returns the HTTP/2 server of handler.
func NewH2(handler fasthttp.RequestHandler, o H2Options) *H2 {
	h := &H2{handler: handler, write: o.WriteTimeout, conns: make(chan net.Conn), closed: make(chan struct{})}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	h.srv = http.Server{
		Handler:        http.HandlerFunc(h.serveStream),
		ConnContext:    func(ctx context.Context, c net.Conn) context.Context { return context.WithValue(ctx, connKey{}, c) },
		Protocols:      &protocols,
		MaxHeaderBytes: o.MaxHeaderBytes,
		IdleTimeout:    o.IdleTimeout,
		ErrorLog:       o.ErrorLog,
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams: int(o.MaxStreams),
			CountError:           o.CountError,
			// A connection that takes no byte of what is to be written
			// for this long is closed (every stream's writes have their
			// own deadline besides).
			WriteByteTimeout: o.WriteTimeout,
		},
	}
	return h
}

// ServeConn serves c, a connection whose handler found it speaks HTTP/2
// (taken over from the server), until it ends; the HTTP/2 server closes
// it.
func (h *H2) ServeConn(c net.Conn) {
	// The server's read deadline for the marker would end the connection.
	_ = c.SetDeadline(time.Time{})
	h.start.Do(func() { go func() { _ = h.srv.Serve(h) }() })
	select {
	case h.conns <- c:
	case <-h.closed:
		_ = c.Close()
	}
}

// Accept gives the HTTP/2 server the next connection (H2 is its
// listener).
func (h *H2) Accept() (net.Conn, error) {
	select {
	case c := <-h.conns:
		return c, nil
	case <-h.closed:
		return nil, net.ErrClosed
	}
}

// Close ends Accept.
func (h *H2) Close() error {
	h.shut.Do(func() { close(h.closed) })
	return nil
}

// Closed reports whether Shutdown (or Close) was called: a server that
// takes no more connections.
func (h *H2) Closed() bool {
	select {
	case <-h.closed:
		return true
	default:
		return false
	}
}

// Addr is the listener's address: none, connections come handed over.
func (h *H2) Addr() net.Addr { return &net.TCPAddr{} }

// Shutdown tells every HTTP/2 client to open no new stream (GOAWAY) and
// waits until their connections closed (each once its streams ended), or
// ctx is done.
func (h *H2) Shutdown(ctx context.Context) error {
	_ = h.Close()
	return h.srv.Shutdown(ctx)
}

func (h *H2) serveStream(w http.ResponseWriter, r *http.Request) {
	s, _ := h.streams.Get().(*h2Stream)
	if s == nil {
		s = new(h2Stream)
	}
	c, _ := r.Context().Value(connKey{}).(net.Conn)
	under := c
	if u, ok := c.(interface{ UnsafeConn() net.Conn }); ok {
		under = u.UnsafeConn() // the server's hijacked connection
	}
	s.conn = Stream{conn: c, cc: Of(under), ctx: r.Context()}
	ctx := &s.ctx
	ctx.Init2(&s.conn, nil, false)
	fromH2(&ctx.Request, r)
	h.handler(ctx)
	h.respond(w, &ctx.Response, &s.conn)
	ctx.Request.Reset()
	ctx.Response.Reset()
	s.conn = Stream{}
	h.streams.Put(s)
}

// fromH2 is the stream's request as the server would have parsed it from
// HTTP/1.1: method, target, authority as Host, header fields, and the body
// as a stream of the length declared (-1: unknown).
func fromH2(req *fasthttp.Request, r *http.Request) {
	req.Header.SetMethod(r.Method)
	req.SetRequestURI(r.RequestURI)
	req.Header.SetHost(r.Host)
	for k, vs := range r.Header {
		if k == "Content-Length" || k == "Host" {
			continue // the body's and the authority's, set below and above
		}
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	if r.Body != nil && r.Body != http.NoBody {
		req.SetBodyStream(r.Body, int(r.ContentLength))
	} else {
		req.Header.SetContentLength(0)
	}
}

// respond writes the handler's response as the stream's: its header
// fields but those of an HTTP/1.1 connection, then the body, each write
// of a body stream flushed as its own DATA frame as the server would
// flush a chunk.
func (h *H2) respond(w http.ResponseWriter, resp *fasthttp.Response, s *Stream) {
	hdr := w.Header()
	for k, v := range resp.Header.All() {
		if connectionField(k) {
			continue
		}
		key := string(k)
		hdr[key] = append(hdr[key], string(v))
	}
	streamed := resp.IsBodyStream()
	switch cl := resp.Header.ContentLength(); {
	case !streamed && !resp.SkipBody:
		hdr["Content-Length"] = []string{strconv.Itoa(len(resp.Body()))}
	case cl >= 0:
		hdr["Content-Length"] = []string{strconv.Itoa(cl)}
	}
	w.WriteHeader(resp.StatusCode())
	rc := http.NewResponseController(w)
	if !streamed {
		if !resp.SkipBody {
			_, _ = w.Write(resp.Body())
		}
		return
	}
	if resp.ImmediateHeaderFlush {
		_ = rc.Flush()
	}
	_ = resp.BodyWriteTo(&flushWriter{w: w, rc: rc, d: h.write, s: s})
}

// connectionField reports a header field of the HTTP/1.1 connection,
// which HTTP/2 forbids (RFC 9113, 8.2.2), and the framing h2 does
// itself.
func connectionField(k []byte) bool {
	for _, f := range [...]string{"Connection", "Keep-Alive", "Proxy-Connection", "Transfer-Encoding", "Upgrade", "Content-Length"} {
		if len(k) == len(f) && bytes.EqualFold(k, []byte(f)) {
			return true
		}
	}
	return false
}

// flushWriter sends each write at once, within d of its start.
// Each write that waits counts in the stream's stall.
type flushWriter struct {
	w     http.ResponseWriter
	rc    *http.ResponseController
	d     time.Duration
	s     *Stream
	timer *time.Timer
}

func (f *flushWriter) Write(b []byte) (int, error) {
	start := time.Now()
	if f.d > 0 {
		_ = f.rc.SetWriteDeadline(start.Add(f.d))
	}
	var before uint64
	cc := f.s.cc
	if cc != nil {
		before = cc.h2w.begunSoFar()
	}
	n, err := f.w.Write(b)
	if err == nil {
		err = f.rc.Flush()
	}
	if err == nil && cc != nil {
		// Until the bytes left (h2Writes): a write that waits for the
		// client's socket counts in the stall, as on HTTP/1.1.
		if f.timer == nil {
			f.timer = time.NewTimer(h2WriteWait)
		} else {
			f.timer.Reset(h2WriteWait)
		}
		if end := cc.h2w.wait(before, int64(len(b))+h2FrameHeader, f.timer.C); end > 0 {
			f.s.counts.Sent = end
		}
		f.timer.Stop()
	}
	if d := time.Since(start); d > stallMin {
		f.s.counts.Stall += d
	}
	return n, err
}

// h2WriteWait bounds a handler's wait for the socket write of its bytes:
// past it the delivery is stamped without (the socket's own write
// deadline ends a connection whose client takes nothing).
const h2WriteWait = time.Second

// h2Writes follows the socket writes of an HTTP/2 connection, for its
// streams' handlers. The HTTP/2 server frames a handler's flushed bytes
// into its buffer, wakes the handler, and only then writes the buffer to
// the socket, from another goroutine: a handler would stamp the
// delivery of its tokens before they left (0.5-1 ms early at the
// median on a busy machine). The bytes enter the buffer when no write of
// it is under way, and the next write takes all of it: among the socket
// writes that start after the handler asked, the first that carries as
// many bytes as its DATA frame, with those before it, is the one that
// carries them (the ones before hold other frames: its HEADERS). The
// handler waits for its end (wait), and stamps the delivery after it as
// an HTTP/1.1 response's is stamped after its write.
type h2Writes struct {
	// rx is the kernel's receive time of the connection's last read: a
	// stream's handler starts after the read that brought its HEADERS
	// frame (Stream.Arrival).
	rx atomic.Int64

	mu          sync.Mutex
	begun, done uint64        // socket writes started, and ended
	wake        chan struct{} // closed when a write ends (nil: no one waits)
	closed      bool
	// ends are the connection's counts of bytes written at the ends of
	// the last writes (write n's at n % len): where a stream's bytes end
	// on the connection, whose acknowledgement the client side watches.
	ends [16]int64
}

func (w *h2Writes) started() {
	w.mu.Lock()
	w.begun++
	w.mu.Unlock()
}

func (w *h2Writes) ended(sent int64) {
	w.mu.Lock()
	w.ends[w.done%uint64(len(w.ends))] = sent
	w.done++
	if w.wake != nil {
		close(w.wake)
		w.wake = nil
	}
	w.mu.Unlock()
}

func (w *h2Writes) close() {
	w.mu.Lock()
	w.closed = true
	if w.wake != nil {
		close(w.wake)
		w.wake = nil
	}
	w.mu.Unlock()
}

// begunSoFar is the count of writes started, before a handler's write.
func (w *h2Writes) begunSoFar() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.begun
}

// sentSoFar is the connection's count of bytes written at the end of
// its last write (0: none yet).
func (w *h2Writes) sentSoFar() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done == 0 {
		return 0
	}
	return w.ends[(w.done-1)%uint64(len(w.ends))]
}

// wait returns once the writes started after the first `after` that
// have ended carry need bytes or more, or the connection closed, or
// timer fired, with the connection's count of bytes written at the end
// of the last of them (where the waiting stream's bytes end: an upper
// bound when the stream's wait came more than len(ends) writes late), or
// 0 when they did not end. need is the stream's bytes and a frame's
// header: a write that carries less holds other frames only. The server
// writes a stream's HEADERS frame into its buffer and then its first
// DATA frame, each on its own call from the handler, and flushes the
// buffer between the two when nothing else is queued: taken as the first
// token's, the write of the HEADERS alone made its client-side time early
// by the DATA frame's time on the path (6.7 ms behind a 32 KiB/s
// bottleneck, now and then).
func (w *h2Writes) wait(after uint64, need int64, timer <-chan time.Time) int64 {
	n := uint64(len(w.ends))
	for {
		w.mu.Lock()
		if w.done > after {
			if w.done-after >= n {
				end := w.ends[(w.done-1)%n] // the start of write `after` is gone
				w.mu.Unlock()
				return end
			}
			var start int64
			if after > 0 {
				start = w.ends[(after-1)%n]
			}
			for k := after; k < w.done; k++ {
				if end := w.ends[k%n]; end-start >= need {
					w.mu.Unlock()
					return end
				}
			}
		}
		if w.closed {
			w.mu.Unlock()
			return 0
		}
		if w.wake == nil {
			w.wake = make(chan struct{})
		}
		wake := w.wake
		w.mu.Unlock()
		select {
		case <-wake:
		case <-timer:
			return 0
		}
	}
}

// h2FrameHeader is the size of an HTTP/2 frame's header.
const h2FrameHeader = 9
