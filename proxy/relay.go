package proxy

import (
	"bytes"
	"io"
	"net"
	"time"

	"github.com/valyala/fasthttp"
)

// bodyRelay is the response body's way from the upstream to the client,
// whatever path it takes: read through the server's body stream (Read,
// for a known length), relayed read by read (WriteTo), passed with its
// chunk framing as it came (passChunks, on the serving goroutine or on a
// relay loop), or written unframed on a hijacked HTTP/1.0 connection
// (relayRaw). The server reads the body through it and then closes it
// (CloseWithError), which finishes the exchange.
//
// Owner: the serving goroutine from relay on; a relay loop while the
// stream is in one (passLoop hands it over and waits for it back).
type bodyRelay struct {
	x             *exchange // the exchange it relays the body of
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
	head      []byte // the response header of an HTTP/1.0 hijacked relay

	pass      bool   // the body is relayed with the upstream's chunk framing (passChunks)
	framed    bool   // passChunks: the server frames what is written, until a chunk boundary
	gathered  []byte // passChunks: the data bytes of a framed read
	wholeRead bool   // passChunks: the body came whole with the header (see passWhole)
	heldOut   []byte // passWhole: the header and the body, held for one write
	keep      int    // passChunks: bytes of a held size line at the front of buf
	endSent   bool   // the body's last chunk went out with its data (passScan)
	chunks    chunkScanner
	loop      loopStream // the stream while a relay loop relays it (loop.go)
	turn      passTurn   // the read the relay loop relays (passloop.go)
}

// kept is the relay's next life in a pooled exchange: its buffers, nothing
// relayed.
func (r *bodyRelay) kept() bodyRelay {
	return bodyRelay{x: r.x, buf: r.buf, head: r.head[:0], gathered: r.gathered[:0], heldOut: r.heldOut[:0],
		loop: loopStream{done: r.loop.done}}
}

// pull reads the upstream once into b and feeds what it read to the
// parser. An upstream error is kept and returned again on every later call;
// when bytes came with it, they are returned first, without the error.
func (r *bodyRelay) pull(b []byte) (int, error) {
	if r.readErr != nil {
		return 0, r.readErr
	}
	n, err := r.body.Read(b)
	if n > 0 {
		r.x.observe(b[:n], r.readTime())
	}
	if err != nil {
		if err == io.EOF {
			r.upDone = true
			r.x.cancel.settle()
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
func (r *bodyRelay) readTime() time.Time {
	if c := r.x.att.conn; c != nil && !c.lastRead().IsZero() {
		return c.lastRead()
	}
	return r.x.p.now()
}

// WriteTo relays the body to the client, one write per upstream read. The
// server frames each write as a chunk and flushes it before Write returns,
// so the delivery of a chunk's tokens is stamped right after its Write.
// fasthttp uses WriteTo for chunked responses (see SupportsBodyWriteTo).
func (r *bodyRelay) WriteTo(w io.Writer) (int64, error) {
	if r.buf == nil {
		r.buf = make([]byte, 8<<10)
	}
	if r.pass {
		return r.passChunks(w)
	}
	var written int64
	for {
		stripping := r.x.tap.strip // parseStrip may give up during this read
		n, err := r.pull(r.buf)
		out := r.buf[:n]
		if stripping {
			if n == 0 {
				r.x.tap.stripped = r.x.tap.stripped[:0]
			}
			out = r.x.tap.stripped
			if err != nil {
				// The stream ends: what is held goes out as it is.
				out = append(out, r.x.tap.held...)
				r.x.tap.held = r.x.tap.held[:0]
			}
		}
		if len(out) > 0 {
			m, werr := w.Write(out)
			written += int64(m)
			r.bytesOut += int64(m)
			if werr != nil {
				return written, werr
			}
			r.wrote(r.x.p.now())
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
// framing as it came: each read of the upstream socket lands in the
// relay's buffer and goes to the client's socket in one write, its data
// bytes handed to the parser on the way. (fasthttp's body stream would
// decode each chunk and frame it again: a copy through its buffer, and a
// read and a write per chunk where several came in one read.)
//
// The response header was flushed before the body (ImmediateHeaderFlush),
// so the server's buffer is empty and writing to the connection keeps the
// order. The server ends every chunked body itself once WriteTo returns,
// after the exchange finished, in a write of its own; trailers were never
// relayed. A bare last chunk (0, no trailers) that came in one read with
// the data before it goes out in the same write instead, and the server's
// copy is dropped (clientConn.endSent): one write and one segment less per
// response, and the response is whole on the wire when its record is
// made. A size line cut by the end of a read is held, at the front of the
// buffer, until it ends: only then can the last chunk be told apart.
//
// When body bytes came with the response header, the header is still in
// the server's buffer: the data of the reads up to the first chunk
// boundary is written through w, which frames it and flushes it with the
// header in one write; the framing goes through as it came from there on.
// A body that came whole with the header goes out with it in one write
// (passWhole).
func (r *bodyRelay) passChunks(w io.Writer) (_ int64, err error) {
	up, cl := r.x.att.conn, clientRx(r.x.client)
	up.setDirect(true)
	setDirect(cl, true)
	defer func() {
		up.setDirect(false)
		setDirect(cl, false)
		if r.endSent && err == nil {
			// The body's end went out already (passScan): the server's
			// own, written only after a body relayed without error, is
			// dropped.
			r.x.cs.cc.endSent = true
		}
	}()
	loop := r.loopable()
	for {
		if loop && !r.framed && r.x.att.conn.buffered() == 0 {
			if moved, err := r.passLoop(); moved {
				return r.bytesOut, err
			}
			loop = false
		}
		if end, err := r.passRead(w); end {
			return r.bytesOut, err
		}
	}
}

// passWhole writes a body that came whole with its response header, bare
// last chunk included: the server frames the data as one chunk after the
// header, the client connection holds what the server writes, and all of
// it goes out with the last chunk in one write (the server's own last
// chunk is dropped later: endSent). Short streams, errors and answers a
// backend had ready come this way: one write instead of three.
func (r *bodyRelay) passWhole(w io.Writer) error {
	cc := r.x.cs.cc
	cc.hold = &r.heldOut
	_, err := w.Write(r.gathered)
	cc.hold = nil
	if err == nil {
		r.heldOut = append(r.heldOut, bareLastChunk...)
		_, err = cc.Write(r.heldOut)
	}
	r.heldOut = r.heldOut[:0]
	if cap(r.heldOut) > maxPooledOut {
		r.heldOut = nil
	}
	return err
}

// passRead relays one read of passChunks; end is true when the body ended
// or failed (err says which).
func (r *bodyRelay) passRead(w io.Writer) (end bool, err error) {
	var n int
	if r.x.att.conn.buffered() > 0 {
		n, err = r.x.att.conn.readBuffered(r.buf[r.keep:]) // what came with the header
	} else {
		n, err = r.x.att.conn.Read(r.buf[r.keep:])
	}
	rawFrom, out, last, data, serr := r.passScan(n)
	if serr != nil {
		err = serr
	}
	if len(r.gathered) > 0 {
		// Framed by the server, and flushed with the header.
		var werr error
		if r.wholeRead {
			werr = r.passWhole(w)
		} else {
			_, werr = w.Write(r.gathered)
		}
		r.gathered = r.gathered[:0]
		if werr != nil {
			r.readErr = err
			return true, werr
		}
	}
	if out > rawFrom {
		if _, werr := r.x.client.Write(r.buf[rawFrom:out]); werr != nil {
			r.readErr = err
			return true, werr
		}
	}
	return r.passDone(data, out > rawFrom, err, last)
}

// passScan follows the framing of the n bytes just read into r.buf (after
// the r.keep bytes of a size line held from the read before), hands their
// data bytes to the parser and says what to write as it came:
// r.buf[rawFrom:out], up to the start of the last chunk, or of a size line
// the read cut (held for the next read: r.keep), or of a framing error
// (err); in the trailers, nothing. last is the end of the bytes read; data
// counts the data bytes. While framed, the data bytes are gathered for the
// server to frame instead.
func (r *bodyRelay) passScan(n int) (rawFrom, out, last, data int, err error) {
	keep := r.keep
	last = keep + n
	if r.framed {
		rawFrom = last
	}
	out, start := last, keep-r.chunks.line
	if r.chunks.lastChunk() {
		out = 0
	}
	// The body's end goes out with the read that brought it, when it is
	// the bare last chunk (no trailers): in that read's write when the
	// header is out before it (see endSent), or with the header, the body
	// and all, when they came together (passWhole). While the header waits,
	// every data byte of the read is gathered, and those after the first
	// chunk boundary are dropped again unless the body ends here.
	wasFramed, endHere, gatheredAt := r.framed, false, -1
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
				r.x.observe(d, at)
				if wasFramed {
					r.gathered = append(r.gathered, d...)
				}
			}
			if serr != nil {
				err, out = serr, min(out, off)
				break
			}
			if r.framed && r.chunks.atBoundary() {
				// A chunk boundary: from here on the bytes go as they came.
				r.framed, rawFrom, gatheredAt = false, off, len(r.gathered)
			}
			if r.chunks.lastChunk() && out == last {
				out, endHere = start, true
			}
			if r.chunks.done() {
				r.upDone, r.stray = true, off < last
				r.x.cancel.settle()
				if endHere && r.x.cs.cc != nil && bytes.Equal(r.buf[start:off], bareLastChunk) {
					switch {
					case wasFramed && len(r.gathered) > 0:
						rawFrom, out, r.wholeRead, r.endSent = last, last, true, true
					case !wasFramed && start >= rawFrom:
						out, r.endSent = off, true
					}
				}
				break
			}
		}
	}
	if gatheredAt >= 0 && !r.wholeRead {
		r.gathered = r.gathered[:gatheredAt]
	}
	r.keep = 0
	if in, l := r.chunks.inSizeLine(); in && out == last && !r.framed {
		out, r.keep = last-l, l
	}
	return rawFrom, out, last, data, err
}

// passDone ends a relayed read whose bytes were written (data bytes of
// it, and whether anything went out: its delivery is stamped): end is true
// when the body ended (err nil) or the read failed (err says how);
// otherwise the held size line moves to the front of the buffer for the
// next read.
func (r *bodyRelay) passDone(data int, wrote bool, err error, last int) (end bool, _ error) {
	if data > 0 || wrote {
		r.bytesOut += int64(data)
		r.wrote(r.x.p.now())
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
func (r *bodyRelay) SupportsBodyWriteTo() bool { return true }

// Read relays one upstream read. fasthttp uses it for bodies of known
// length; their chunks are only flushed at the end, so the start of the next
// Read is when the previous chunk was handed to the server.
func (r *bodyRelay) Read(b []byte) (int, error) {
	if r.unstamped {
		r.wrote(r.x.p.now())
	}
	n, err := r.pull(b)
	if n > 0 {
		r.bytesOut += int64(n)
		r.unstamped = true
	}
	return n, err
}

// wrote stamps the delivery of the last chunk handed to the server.
func (r *bodyRelay) wrote(t time.Time) {
	r.unstamped = false
	sent := r.x.cs.sent()
	tok, ans := r.x.tap.wrote(t, r.x.cs.stalled(), sent)
	r.x.cs.laterBytes(t)
	r.x.markAcks(tok, ans, t, sent)
}

// relayRaw writes the prepared header and then every chunk straight to the
// client connection, each Write reaching the socket at once. On an upstream
// failure the connection is reset, not closed cleanly, so the client can
// tell a broken body from a complete one.
func (r *bodyRelay) relayRaw(c net.Conn) {
	if _, err := c.Write(r.head); err != nil {
		r.x.finish(err)
		return
	}
	_, err := r.WriteTo(c)
	if err != nil && r.readErr != nil && r.readErr != io.EOF {
		// The upstream broke: reset rather than close cleanly.
		if tc, ok := r.x.client.(interface{ SetLinger(int) error }); ok {
			_ = tc.SetLinger(0)
		}
	}
	r.x.finish(err)
}

// CloseWithError is called by the server once the response has been
// written (err == nil) or has failed (err is the write error, or the read
// error Read returned). It finishes the exchange.
func (r *bodyRelay) CloseWithError(err error) error {
	r.x.finish(err)
	return nil
}

// maxPooledOut is the largest passWhole buffer kept for the next response.
const maxPooledOut = 32 << 10

// bareLastChunk ends a chunked body that has no trailers.
var bareLastChunk = []byte("0\r\n\r\n")

// clientRx returns the client connection's rxConn, or nil.
func clientRx(c net.Conn) *rxConn {
	if cc, ok := c.(*clientConn); ok {
		return cc.rxConn
	}
	return nil
}

// setDirect turns the relay loop's direct socket calls on or off.
func setDirect(c *rxConn, on bool) {
	if c != nil {
		c.direct = on
	}
}

// serveHTTP10 relays a body of unknown length to an HTTP/1.0 client, which
// cannot read chunked encoding: the body goes out unframed on a hijacked
// connection, ended by closing it. fasthttp would send chunked encoding.
func (r *bodyRelay) serveHTTP10(ctx *fasthttp.RequestCtx) {
	h := &ctx.Response.Header
	h.SetContentLength(-2) // identity: no Content-Length, no Transfer-Encoding
	h.SetConnectionClose()
	h.SetProtocol([]byte("HTTP/1.0"))
	r.head = append(r.head[:0], h.Header()...)
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(r.relayRaw)
}
