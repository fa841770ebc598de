package proxy

import (
	"io"
	"net"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// exchange is one request in flight. After ServeHTTP it is also the body
// stream the server copies to the client (ctx.SetBodyStream(x, n)): each
// Read relays one upstream read, and CloseWithError, called by the server
// once the response is written or failed, finishes the record.
//
// fasthttp calls Read and CloseWithError from the connection's goroutine,
// the one that ran ServeHTTP; only cancel is touched by the peer watcher.
type exchange struct {
	p    *Proxy
	snap *snapshot
	rec  metrics.Record
	id   []byte

	route   *route
	dialect dialect.Dialect
	req     *fasthttp.Request
	resp    *fasthttp.Response
	conn    *upConn
	body    io.Reader
	client  net.Conn
	watch   peerWatch
	cancel  cancelState
	fire    func() // cancel.fire, made once per pooled exchange

	// What the body is and how it is parsed.
	streamed      bool // text/event-stream or NDJSON: measured event by event
	mode          parseMode
	parser        *sse.Parser
	lines         *sse.Lines
	whole         []byte       // a non-streamed body, kept up to MaxEventBytes
	dec           *sideDecoder // decompresses a copy of a compressed body
	buf           []byte       // WriteTo's read buffer
	strip         bool         // drop the usage-only chunk tokentap asked for
	held          []byte       // strip: bytes of an event not yet complete
	stripped      []byte       // strip: the bytes of the last read to relay
	decTimes      []chunkTimes // compressed chunks not yet decoded, from decBase on
	decBase       int
	contentLength int
	head          []byte // the response header of an HTTP/1.0 hijacked relay
	injected      []byte // the request body with include_usage injected
	path          []byte // the normalised request path
	query         []byte // the raw query, with its "?", a view of the request
	reqBody       []byte // the request body, read in bounded pieces
	scratch       []byte // header values being built

	// What is measured, and whether a chunk handed to the server awaits
	// its delivery stamp (the fixed-length path, see Read).
	m         meter
	unflushed bool

	// Admission control.
	tenant    string
	ticket    *ratelimit.Ticket
	estIn     int64 // estimated input tokens
	responded bool  // the upstream answered with headers

	bytesOut int64
	readErr  error // an upstream read error, returned again on every Read
	upDone   bool  // the upstream body was read to its end
	finished bool
}

type parseMode uint8

const (
	parseNone parseMode = iota
	parseSSE
	parseLines
	parseBody
)

func (p *Proxy) acquireExchange(s *snapshot, arrival time.Time) *exchange {
	x, _ := p.pool.Get().(*exchange)
	if x == nil {
		x = &exchange{p: p, req: new(fasthttp.Request), resp: new(fasthttp.Response)}
		x.fire = x.cancel.fire
	}
	p.inflight.Add(1)
	x.snap = s
	x.m.reset(arrival)
	x.rec.Reset()
	x.rec.Tenant = "default"
	x.rec.Outcome = metrics.OutcomeOK
	return x
}

func (p *Proxy) releaseExchange(x *exchange) {
	x.req.Reset()
	x.resp.Reset()
	body := x.reqBody[:0]
	if cap(body) > maxPooledBody {
		body = nil // a large body's buffer goes with its request
	}
	*x = exchange{
		p: p, id: x.id[:0], head: x.head[:0], parser: x.parser, lines: x.lines, buf: x.buf,
		held: x.held[:0], stripped: x.stripped[:0], injected: x.injected[:0], scratch: x.scratch[:0],
		whole: x.whole[:0], m: meter{gaps: x.m.gaps[:0]}, decTimes: x.decTimes[:0], req: x.req, resp: x.resp, path: x.path[:0], reqBody: body,
		watch: peerWatch{done: x.watch.done, timer: x.watch.timer, peekFn: x.watch.peekFn}, fire: x.fire,
	}
	p.pool.Put(x)
}

// maxPooledBody is the largest request body buffer kept for the next
// request.
const maxPooledBody = 256 << 10

// pull reads the upstream once into b and feeds what it read to the
// parser. An upstream error is kept and returned again on every later call;
// when bytes came with it, they are returned first, without the error.
func (x *exchange) pull(b []byte) (int, error) {
	if x.readErr != nil {
		return 0, x.readErr
	}
	n, err := x.body.Read(b)
	if n > 0 {
		// Stamped with the kernel's receive time of the bytes: time they
		// waited in the socket is time tokentap added.
		var at time.Time
		if x.conn != nil {
			at = x.conn.readAt
		}
		if at.IsZero() {
			at = x.p.now()
		}
		x.observe(b[:n], at)
	}
	if err != nil {
		if err == io.EOF {
			x.upDone = true
		}
		x.readErr = err
		if n > 0 {
			return n, nil
		}
	}
	return n, err
}

// WriteTo relays the body to the client, one write per upstream read. The
// server frames each write as a chunk and flushes it before Write returns,
// so the delivery of a chunk's tokens is stamped right after its Write.
// fasthttp uses WriteTo for chunked responses (see SupportsBodyWriteTo).
func (x *exchange) WriteTo(w io.Writer) (int64, error) {
	if x.buf == nil {
		x.buf = make([]byte, 8<<10)
	}
	var written int64
	for {
		stripping := x.strip // parseStrip may give up during this read
		n, err := x.pull(x.buf)
		out := x.buf[:n]
		if stripping {
			if n == 0 {
				x.stripped = x.stripped[:0]
			}
			out = x.stripped
			if err != nil {
				// The stream ends: what is held goes out as it is.
				out = append(out, x.held...)
				x.held = x.held[:0]
			}
		}
		if len(out) > 0 {
			m, werr := w.Write(out)
			written += int64(m)
			x.bytesOut += int64(m)
			if werr != nil {
				return written, werr
			}
			x.flushed(x.p.now())
		}
		if err == io.EOF {
			return written, nil
		}
		if err != nil {
			return written, err
		}
	}
}

// SupportsBodyWriteTo tells fasthttp that WriteTo does what Read does.
func (x *exchange) SupportsBodyWriteTo() bool { return true }

// Read relays one upstream read. fasthttp uses it for bodies of known
// length; their chunks are only flushed at the end, so the start of the next
// Read is when the previous chunk was handed to the server.
func (x *exchange) Read(b []byte) (int, error) {
	if x.unflushed {
		x.flushed(x.p.now())
	}
	n, err := x.pull(b)
	if n > 0 {
		x.bytesOut += int64(n)
		x.unflushed = true
	}
	return n, err
}

// flushed stamps the delivery of the last chunk handed to the server.
func (x *exchange) flushed(t time.Time) {
	x.unflushed = false
	if x.dec != nil && len(x.decTimes) > 0 && x.decTimes[len(x.decTimes)-1].flush.IsZero() {
		// Its tokens are stamped once decoded (takeDecoded).
		x.decTimes[len(x.decTimes)-1].flush = t
	}
	x.m.flushed(t)
}

// CloseWithError is called by the server once the response has been
// written (err == nil) or has failed (err is the write error, or the read
// error Read returned). It finishes the exchange.
func (x *exchange) CloseWithError(err error) error {
	x.finish(err)
	return nil
}

// finish ends the exchange exactly once: it settles the upstream
// connection and stops the peer watch at once, then completes the record
// and hands it to the sinks. For a compressed response the record is
// completed on a goroutine of its own once the side decoder has decoded
// what it was given, so the end of the response never waits for it.
func (x *exchange) finish(writeErr error) {
	if x.finished {
		return
	}
	x.finished = true
	now := x.p.now()
	rec := &x.rec

	complete := x.upDone || (x.contentLength >= 0 && x.bytesOut == int64(x.contentLength))
	if x.unflushed && writeErr == nil {
		// The last chunk went out with the end of the response.
		x.flushed(now)
	}
	x.watch.stop()
	gone := x.cancel.isGone()

	// The upstream connection goes back to the pool only after a complete,
	// clean response; anything else closes it, which also cancels the
	// request at the backend.
	if x.conn != nil {
		x.cancel.detach()
		_ = x.resp.CloseBodyStream()
		if complete && !gone && writeErr == nil && rec.Outcome != metrics.OutcomeClientCancel && !x.resp.ConnectionClose() {
			x.route.up.put(x.conn)
		} else {
			x.route.up.discard(x.conn)
		}
		x.conn = nil
	}
	if x.client != nil {
		rec.ClientRTT = clientRTT(x.client, now)
		x.client = nil
	}
	if x.dec != nil {
		go x.record(now, writeErr, gone, complete)
		return
	}
	x.record(now, writeErr, gone, complete)
}

// record completes the record: what the body said, the outcome, the
// timings; then the sinks, and the exchange goes back to the pool.
func (x *exchange) record(now time.Time, writeErr error, gone, complete bool) {
	rec := &x.rec
	// Everything the body says is known before the outcome is decided.
	if x.dec != nil {
		whole := x.dec.close()
		x.takeDecoded()
		if !whole && complete || x.dec.over || x.dec.dropped {
			rec.Partial = true // the copy did not decode (or past a limit); the relay was unaffected
		}
		x.dec = nil
	}
	if x.mode == parseBody && complete && len(x.whole) > 0 {
		o := x.dialect.Body(x.whole)
		o.Token, o.Answer = false, false
		x.m.observe(o, now)
	}

	// The outcome, upstream faults before client faults. Error texts are
	// tokentap's words: no address, no upstream bytes.
	switch {
	case rec.Outcome != metrics.OutcomeOK:
		// Set by fail.
	case x.p.cutting.Load() && (gone || writeErr != nil || !complete):
		rec.Outcome, rec.Error = metrics.OutcomeShutdown, "cut at shutdown: the drain timeout ran out"
	case gone:
		rec.Outcome, rec.Error = metrics.OutcomeClientCancel, "client closed the connection"
	case x.readErr != nil && x.readErr != io.EOF:
		if isTimeout(x.readErr) {
			rec.Outcome = metrics.OutcomeUpstreamTimeout
		} else {
			rec.Outcome = metrics.OutcomeUpstreamError
		}
		rec.Error = "upstream stream broken: " + describeStreamError(x.readErr)
	case x.body != nil && !complete && writeErr == nil && x.contentLength >= 0:
		rec.Outcome, rec.Error = metrics.OutcomeUpstreamError, "the upstream response ended before its Content-Length"
	case writeErr != nil || (x.body != nil && !complete):
		rec.Outcome = metrics.OutcomeClientCancel
		if writeErr != nil {
			rec.Error = "cannot write to client: " + describeStreamError(writeErr)
		}
	case rec.Status >= 500 || x.m.streamError:
		rec.Outcome = metrics.OutcomeUpstreamError
		if x.m.streamError {
			rec.Error = "error reported inside the response"
		}
	}

	x.fillRecord(now)
	x.releaseTicket()
	x.snap.metrics.Observe(rec)
	for _, s := range x.p.opts.Sinks {
		s.Observe(rec)
	}
	x.p.inflight.Add(-1)
	x.p.releaseExchange(x)
}

// fillRecord derives the record's timings from the meter.
func (x *exchange) fillRecord(now time.Time) {
	x.rec.BytesOut = x.bytesOut
	x.m.fill(&x.rec, now, x.streamed)
}
