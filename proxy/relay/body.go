// Package relay is the response body's way from the upstream to the
// client, whatever path it takes (Body): read through the server's body
// stream, or written by tokentap itself on a connection the server
// handed over, with the upstream's chunk framing as it came, on the
// connection's goroutine or on a relay loop (proxy/internal/relayplane).
// It knows the measurement only as a Meter and the exchange only as its
// Sink, and imports neither.
package relay

import (
	"bytes"
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/relayplane"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/valyala/fasthttp"
)

// Body is the response body's way from the upstream to the client,
// whatever path it takes. One writer per response: either the server
// writes all of it, reading the body through the relay (Read, for a known
// length; WriteTo, read by read, which the server frames as chunks) and
// then closing it (CloseWithError), which finishes the exchange; or
// tokentap writes all of it, header included, on a connection the server
// handed over and writes nothing more to (a hijack without a response):
// the chunked body with its framing as it came (passChunks, on the
// connection's goroutine or on a relay loop), or an HTTP/1.0 body
// unframed (relayRaw).
//
// Owner: the serving goroutine from relay on (the hijack's goroutine for
// the responses tokentap writes); a relay loop while the stream is in one
// (passLoop hands it over and the hijack's goroutine returns); then the
// goroutine started as the loop lets go of the stream (afterLoop).
type Body struct {
	Parts
	// The response's connections: the upstream's it comes on, the
	// client's it goes to (bind).
	up            *upstream.Conn
	client        net.Conn
	body          io.Reader
	buf           []byte // WriteTo's read buffer
	contentLength int
	bytesOut      int64
	readErr       error // an upstream read error, returned again on every Read
	upDone        bool  // the upstream body was read to its end
	stray         bool  // bytes came after the end of the response
	// unstamped: a chunk handed to the server awaits its delivery stamp
	// (the fixed-length path, see Read).
	unstamped bool
	head      []byte // the response header of a response tokentap writes (passChunks, relayRaw)

	headOwed bool // passChunks: the response header (head) is not written yet
	keepConn bool // passChunks: the client connection serves more requests after the response
	keep     int  // passChunks: bytes of a held size line at the front of buf
	chunks   chunkScanner
	loop     relayplane.Handle // the stream while a relay loop relays it
	turn     passTurn          // the read the relay loop relays (passloop.go)
	// wait, when set, takes the end of a stream that left a relay loop in
	// place of endPass: for a caller that drives passChunks itself and
	// waits for the stream's end (the relay's tests and benchmarks).
	wait chan error
}

// Sink is the exchange a body relay relays the body of, as the relay
// sees it: told the body's bytes as they are read (Observe), each chunk's
// delivery (Delivered), a client that left (ClientLeft) and the end
// (Finish); asked to stop watching its client when a relay loop takes the
// stream (Unwatch: the loop watches the client's close itself) and to
// watch it again when the stream stays on, or comes back to, its
// goroutine (Rewatch).
type Sink interface {
	Observe(b []byte, t time.Time)
	Delivered(t time.Time)
	ClientLeft()
	Unwatch()
	Rewatch()
	Finish(err error)
}

// Meter is what the relay needs of the measurement (measure.Tap): which
// bytes of a read to relay while the usage chunk tokentap asked for is
// stripped, and whether a side decoder measures the body (it could hold a
// relay loop up).
type Meter interface {
	Stripping() bool
	Stripped(n int, end bool) []byte
	Decoding() bool
}

// Server is the server whose connections the responses go out on, as
// plain fields (its clock, its relay loops, whether it is stopping, and
// how a connection is given back to it after a response tokentap wrote),
// made once by the proxy.
type Server struct {
	Now      func() time.Time
	Loops    *relayplane.Set // nil: every stream stays on its goroutine
	Stopping *atomic.Bool
	// Resume serves the next requests of a connection handed over, on the
	// calling goroutine, until it is closed or handed over again.
	Resume func(*downstream.Conn)
}

// Parts are a relay's collaborators, fixed for its pooled exchange's
// life: the exchange as a sink, the parts of it the relay works with, and
// the server whose connection the response goes out on.
type Parts struct {
	Sink   Sink
	Meter  Meter
	Cancel *downstream.Cancel // the response's settling, a relay loop's entry and exit
	Server *Server
}

// bind gives the relay the response's connections.
func (r *Body) bind(up *upstream.Conn, client net.Conn) { r.up, r.client = up, client }

// Start gives the relay a response's body, read from up, going to client
// (nil: nowhere, a shadow copy's), of contentLength bytes (-1: unknown,
// relayed chunked).
func (r *Body) Start(body io.Reader, up *upstream.Conn, client net.Conn, contentLength int) {
	r.body, r.contentLength = body, contentLength
	r.bind(up, client)
}

// NoBody ends a response that has no body (HEAD, 204, 304), or one
// relayed whole otherwise (n bytes: a refused upgrade's answer, a
// tunnel's bytes down).
func (r *Body) NoBody(n int64) { r.upDone, r.bytesOut = true, n }

// End is the relay's word at the response's end, at now, after a write
// error writeErr (nil: none): whether the body came whole (to its end, or
// its Content-Length), the delivery of the last chunk handed to the
// server stamped where it went out with the end.
func (r *Body) End(now time.Time, writeErr error) (complete bool) {
	complete = r.upDone || (r.contentLength >= 0 && r.bytesOut == int64(r.contentLength))
	if r.unstamped && writeErr == nil {
		// The last chunk went out with the end of the response.
		r.wrote(now)
	}
	return complete
}

// Stray reports bytes after the end of the response: its connection is
// not reused.
func (r *Body) Stray() bool { return r.stray }

// BytesOut is the body's bytes relayed (data bytes, without chunk framing).
func (r *Body) BytesOut() int64 { return r.bytesOut }

// ReadErr is the upstream read's error that ended the body (io.EOF: its
// end; nil: none yet).
func (r *Body) ReadErr() error { return r.readErr }

// Started reports a body given to the relay (Start).
func (r *Body) Started() bool { return r.body != nil }

// Fixed reports a body relayed with a known length.
func (r *Body) Fixed() bool { return r.contentLength >= 0 }

// Pass relays the rest of a chunked body to the client with its framing
// as it came, as ServePass's hijack does, and returns how it ended once it
// has, on a relay loop or on the calling goroutine; the connection goes
// back to no server. For a caller that drives a relay itself (the relay's
// tests and benchmarks).
func (r *Body) Pass() error {
	r.wait = make(chan error, 1)
	if moved, err := r.passChunks(nil); !moved {
		return err
	}
	return <-r.wait
}

// PassRead relays one read of such a body on the calling goroutine:
// end is true when the body ended or failed (err says which).
func (r *Body) PassRead() (end bool, err error) {
	if r.buf == nil {
		r.buf = relayplane.NewBuf()
	}
	return r.passRead()
}

// Drain reads the body to its end, each read measured, writing nothing (a
// shadow copy's response: measured and discarded).
func (r *Body) Drain() {
	if cap(r.buf) < 16<<10 {
		r.buf = make([]byte, 16<<10)
	}
	buf := r.buf[:cap(r.buf)]
	for {
		if _, err := r.Read(buf); err != nil {
			return
		}
	}
}

// Kept is the relay's next life in a pooled exchange: its buffers, nothing
// relayed.
func (r *Body) Kept() Body {
	return Body{Parts: r.Parts, buf: r.buf, head: r.head[:0]}
}

// pull reads the upstream once into b and feeds what it read to the
// parser. An upstream error is kept and returned again on every later call;
// when bytes came with it, they are returned first, without the error.
func (r *Body) pull(b []byte) (int, error) {
	if r.readErr != nil {
		return 0, r.readErr
	}
	n, err := r.body.Read(b)
	if n > 0 {
		r.Sink.Observe(b[:n], r.readTime())
	}
	if err != nil {
		if err == io.EOF {
			r.upDone = true
			r.Cancel.Settle()
		}
		r.readErr = err
		if n > 0 {
			return n, nil
		}
	}
	return n, err
}

// readTime is when the bytes of the last upstream read arrived: the
// kernel's receive time where there is one (time they waited in the socket
// is time tokentap added), else now.
func (r *Body) readTime() time.Time {
	if c := r.up; c != nil && !c.LastRead().IsZero() {
		return c.LastRead()
	}
	return r.Server.Now()
}

// WriteTo relays the body to the client, one write per upstream read. The
// server frames each write as a chunk and flushes it before Write returns,
// so the delivery of a chunk's tokens is stamped right after its Write.
// fasthttp uses WriteTo for chunked responses (see SupportsBodyWriteTo).
func (r *Body) WriteTo(w io.Writer) (int64, error) {
	if r.buf == nil {
		r.buf = relayplane.NewBuf()
	}
	var written int64
	for {
		stripping := r.Meter.Stripping() // it may stop during this read
		n, err := r.pull(r.buf)
		out := r.buf[:n]
		if stripping {
			// At the stream's end what is held goes out as it is.
			out = r.Meter.Stripped(n, err != nil)
		}
		if len(out) > 0 {
			m, werr := w.Write(out)
			written += int64(m)
			r.bytesOut += int64(m)
			if werr != nil {
				return written, werr
			}
			r.wrote(r.Server.Now())
		}
		if err == io.EOF {
			return written, nil
		}
		if err != nil {
			return written, err
		}
	}
}

// passChunks relays a chunked upstream body to a chunked client with its
// framing as it came, and the response header before it: tokentap writes
// the whole response itself, on a connection the server handed over
// (servePass), and the server writes nothing of it. Each read of the
// upstream socket lands in the relay's buffer and goes to the client's
// socket in one write, its data bytes handed to the parser on the way.
// (fasthttp's body stream would decode each chunk and frame it again: a
// copy through its buffer, and a read and a write per chunk where several
// came in one read.)
//
// The header goes out at once, so a client sees it during a long
// prefill; when body bytes came with it, they go out together in one
// write instead (a body that came whole with its header, short streams,
// errors and answers a backend had ready: one write). The body's end goes
// out with the read that brought it; trailers are not relayed (the last
// chunk goes out bare). A size line cut by the end of a read is held, at
// the front of the buffer, until it ends: only then can the last chunk be
// told apart.
func (r *Body) passChunks(hj net.Conn) (moved bool, err error) {
	if r.buf == nil {
		r.buf = relayplane.NewBuf()
	}
	up := r.up
	if r.headOwed && up.Buffered() == 0 {
		if err := r.writeOut(nil); err != nil {
			return false, err
		}
	}
	if r.loopable() {
		for r.headOwed || up.Buffered() > 0 {
			if end, err := r.passRead(); end {
				return false, err
			}
		}
		// A stream that moves into a loop may stay open for minutes: the
		// header it wrote is not held meanwhile (the exchange's next
		// response grows a buffer anew).
		head := r.head
		r.head = nil
		if r.passLoop(hj) {
			return true, nil
		}
		r.head = head
	}
	return false, r.passRest()
}

// passRest relays the rest of a passChunks stream on the calling
// goroutine.
func (r *Body) passRest() error {
	for {
		if end, err := r.passRead(); end {
			return err
		}
	}
}

// writeOut writes b to the client, after the response header while it is
// owed: the two in one write.
func (r *Body) writeOut(b []byte) error {
	if r.headOwed {
		r.headOwed = false
		if len(b) > 0 {
			r.head = append(r.head, b...)
		}
		_, err := r.client.Write(r.head)
		if cap(r.head) > maxPooledOut {
			r.head = nil
		}
		return err
	}
	_, err := r.client.Write(b)
	return err
}

// passRead relays one read of passChunks; end is true when the body ended
// or failed (err says which).
func (r *Body) passRead() (end bool, err error) {
	var n int
	if r.up.Buffered() > 0 {
		n, err = r.up.ReadBuffered(r.buf[r.keep:]) // what came with the header
	} else {
		n, err = r.up.Read(r.buf[r.keep:])
	}
	out, last, data, serr := r.passScan(n)
	if serr != nil {
		err = serr
	}
	if out > 0 || r.headOwed {
		if werr := r.writeOut(r.buf[:out]); werr != nil {
			r.readErr = err
			return true, werr
		}
	}
	return r.passDone(data, out > 0, err, last)
}

// passScan follows the framing of the n bytes just read into r.buf (after
// the r.keep bytes of a size line held from the read before), hands their
// data bytes to the parser and says what to write as it came: r.buf[:out],
// up to the start of the last chunk, of a size line the read cut (held for
// the next read: r.keep), or of a framing error (err). The body's end goes
// out with the read that ends it: as it came when it is the bare last
// chunk, else as a bare last chunk written over what the trailers took in
// the buffer (trailers are not relayed). last is the end of the bytes
// read; data counts the data bytes.
func (r *Body) passScan(n int) (out, last, data int, err error) {
	keep := r.keep
	last = keep + n
	out, start := last, keep-r.chunks.line
	if r.chunks.lastChunk() {
		out = 0 // the last chunk began in an earlier read
	}
	if n > 0 {
		at := r.readTime()
		for off := keep; off < last; {
			if in, l := r.chunks.inSizeLine(); in {
				start = off - l
			}
			d, k, serr := r.chunks.next(r.buf[off:last])
			off += k
			if len(d) > 0 {
				data += len(d)
				r.Sink.Observe(d, at)
			}
			if serr != nil {
				err, out = serr, min(out, off)
				break
			}
			if r.chunks.lastChunk() && out == last {
				out = start
			}
			if r.chunks.done() {
				r.upDone, r.stray = true, off < last
				r.Cancel.Settle()
				if out == start && bytes.Equal(r.buf[start:off], bareLastChunk) {
					out = off
				} else {
					// What lies from out on is the last chunk and its
					// trailers, at least as long as a bare last chunk.
					out += copy(r.buf[out:], bareLastChunk)
				}
				break
			}
		}
	}
	r.keep = 0
	if in, l := r.chunks.inSizeLine(); in && out == last {
		out, r.keep = last-l, l
	}
	return out, last, data, err
}

// passDone ends a relayed read whose bytes were written (data bytes of
// it, and whether anything went out: its delivery is stamped): end is true
// when the body ended (err nil) or the read failed (err says how);
// otherwise the held size line moves to the front of the buffer for the
// next read.
func (r *Body) passDone(data int, wrote bool, err error, last int) (end bool, _ error) {
	if data > 0 || wrote {
		r.bytesOut += int64(data)
		r.wrote(r.Server.Now())
	}
	if r.upDone {
		r.readErr = io.EOF
		return true, nil
	}
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF // the body ended before its last chunk
		}
		r.readErr = err
		return true, err
	}
	copy(r.buf, r.buf[last-r.keep:last])
	return false, nil
}

// SupportsBodyWriteTo tells fasthttp that WriteTo does what Read does.
func (r *Body) SupportsBodyWriteTo() bool { return true }

// Read relays one upstream read. fasthttp uses it for bodies of known
// length; their chunks are only flushed at the end, so the start of the next
// Read is when the previous chunk was handed to the server.
func (r *Body) Read(b []byte) (int, error) {
	if r.unstamped {
		r.wrote(r.Server.Now())
	}
	n, err := r.pull(b)
	if n > 0 {
		r.bytesOut += int64(n)
		r.unstamped = true
	}
	return n, err
}

// wrote stamps the delivery of the last chunk handed to the server.
func (r *Body) wrote(t time.Time) {
	r.unstamped = false
	r.Sink.Delivered(t)
}

// relayRaw writes the prepared header and then every chunk straight to the
// client connection, each Write reaching the socket at once. On an upstream
// failure the connection is reset, not closed cleanly, so the client can
// tell a broken body from a complete one.
func (r *Body) relayRaw(c net.Conn) {
	defer c.Close() // after finish: the server keeps hijacked connections open
	if _, err := c.Write(r.head); err != nil {
		r.Sink.Finish(err)
		return
	}
	_, err := r.WriteTo(c)
	if err != nil && r.readErr != nil && r.readErr != io.EOF {
		// The upstream broke: reset rather than close cleanly.
		if tc, ok := r.client.(interface{ SetLinger(int) error }); ok {
			_ = tc.SetLinger(0)
		}
	}
	r.Sink.Finish(err)
}

// CloseWithError is called by the server once the response has been
// written (err == nil) or has failed (err is the write error, or the read
// error Read returned). It finishes the exchange.
func (r *Body) CloseWithError(err error) error {
	r.Sink.Finish(err)
	return nil
}

// maxPooledOut is the largest header buffer (with the body bytes that came
// with the header) kept for the next response.
const maxPooledOut = 32 << 10

// bareLastChunk ends a chunked body that has no trailers.
var bareLastChunk = []byte("0\r\n\r\n")

// ServeHTTP10 relays a body of unknown length to an HTTP/1.0 client, which
// cannot read chunked encoding: the body goes out unframed on a hijacked
// connection, ended by closing it. fasthttp would send chunked encoding.
func (r *Body) ServeHTTP10(ctx *fasthttp.RequestCtx) {
	h := &ctx.Response.Header
	h.SetContentLength(-2) // identity: no Content-Length, no Transfer-Encoding
	h.SetConnectionClose()
	h.SetProtocol([]byte("HTTP/1.0"))
	r.head = append(r.head[:0], h.Header()...)
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(r.relayRaw)
}

// ServePass has tokentap write the whole response, header and all, with
// the upstream's chunk framing as it came (passChunks): the server hands
// the connection over without writing anything (a hijack without a
// response) and takes it back for the next request once the body ended at
// its last chunk (Proxy.resume). A response that asks to close the
// connection, or ends in an error, or comes during a shutdown closes it,
// as the server does.
func (r *Body) ServePass(ctx *fasthttp.RequestCtx, resp *fasthttp.Response) {
	h := &ctx.Response.Header
	h.SetContentLength(-1) // Transfer-Encoding: chunked
	r.keepConn = !ctx.Request.Header.ConnectionClose() && !h.ConnectionClose() && !r.Server.Stopping.Load()
	if !r.keepConn {
		h.SetConnectionClose()
	}
	r.head, r.headOwed = h.AppendBytes(r.head[:0]), true
	// passChunks reads the connection itself: the body stream, which
	// holds the connection's reader (see upstream.Conn.ParkReader), goes now.
	_ = resp.CloseBodyStream()
	r.body = nil
	cc := r.client.(*downstream.Conn) // a pass is only for a plain client connection
	cc.HandOver()
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(r.relayPass)
}

// relayPass relays a passChunks response on the connection the server
// handed over (hj, which reads through the server's read buffer). It runs
// on the hijack's goroutine, which owns the exchange from here: it ends the
// response (endPass) unless a relay loop took the stream, which carries the
// exchange on from there (afterLoop); either way this goroutine then
// returns, and the server lets go of its read buffer and the request's
// context.
func (r *Body) relayPass(hj net.Conn) {
	relayplane.GrowStack()
	if moved, err := r.passChunks(hj); !moved {
		r.endPass(hj, err)
	}
}

// endPass ends a passChunks response that ended with err: it finishes the
// exchange and then gives the connection back to the server (Proxy.resume)
// or closes it. On the hijack's goroutine, hj is the hijacked connection:
// its read-ahead bytes go back with the connection, and the server takes
// it on a goroutine of its own, so that the hijack's returns. On the
// goroutine a relay loop started (hj nil: passLoop took those bytes), the
// server takes it on this one.
func (r *Body) endPass(hj net.Conn, err error) {
	cc := r.client.(*downstream.Conn)
	keep := err == nil && r.upDone && r.keepConn
	if keep && hj != nil {
		// A pipelined request the server had read ahead goes back with
		// the connection.
		cc.TakeBuffered(hj, r.buf)
	}
	srv := r.Server
	r.Sink.Finish(err) // the exchange, and this relay with it, may be released from here on
	if !keep {
		_ = cc.Close()
		return
	}
	// The rest of the connection's life is the server's again.
	if hj != nil {
		go func() {
			relayplane.GrowStack()
			srv.Resume(cc)
		}()
	} else {
		srv.Resume(cc)
	}
}
