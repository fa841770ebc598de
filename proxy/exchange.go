package proxy

import (
	"bytes"
	"io"
	"net"
	"slices"
	"sync"
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
	watch   *peerWatch
	cancel  cancelState

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
	decAt         time.Time    // read time of the chunk being decoded
	contentLength int
	head          []byte // the response header of an HTTP/1.0 hijacked relay
	injected      []byte // the request body with include_usage injected

	// Clock marks.
	arrival, written                time.Time
	firstByteRead, firstByteFlush   time.Time
	firstTokenRead, firstTokenFlush time.Time
	firstAnswerFlush                time.Time
	lastTokenFlush, lastFlush       time.Time

	chunkTokens  int  // token events in the chunk being flushed
	chunkAnswers int  // of which answers
	unflushed    bool // a chunk was handed to the server and not yet flushed
	gaps         []time.Duration
	events       int
	usage        usage
	items        int
	timings      dialect.Timings
	streamError  bool

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

// usage is the token usage the response reported, merged across events.
type usage struct {
	hasIn, hasOut bool
	in, out       int
}

type parseMode uint8

const (
	parseNone parseMode = iota
	parseSSE
	parseLines
	parseBody
)

// maxGaps bounds the inter-token gaps kept per request for its ITL
// percentiles (every gap still goes to the histogram).
const maxGaps = 1 << 16

func (p *Proxy) acquireExchange(s *snapshot, arrival time.Time) *exchange {
	x, _ := p.pool.Get().(*exchange)
	if x == nil {
		x = &exchange{p: p, req: new(fasthttp.Request), resp: new(fasthttp.Response)}
	}
	x.snap = s
	x.arrival = arrival
	x.rec.Reset()
	x.rec.Tenant = "default"
	x.rec.Outcome = metrics.OutcomeOK
	return x
}

func (p *Proxy) releaseExchange(x *exchange) {
	x.req.Reset()
	x.resp.Reset()
	*x = exchange{
		p: p, id: x.id[:0], head: x.head[:0], parser: x.parser, lines: x.lines, buf: x.buf,
		held: x.held[:0], stripped: x.stripped[:0], injected: x.injected[:0],
		whole: x.whole[:0], gaps: x.gaps[:0], req: x.req, resp: x.resp,
	}
	p.pool.Put(x)
}

// startParsing chooses how the body is measured from its Content-Type and
// Content-Encoding.
func (x *exchange) startParsing(resp *fasthttp.Response) {
	ct := resp.Header.ContentType()
	if i := bytes.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = bytes.TrimSpace(ct)
	switch {
	case bytes.EqualFold(ct, []byte("text/event-stream")):
		x.streamed, x.mode = true, parseSSE
	case bytes.EqualFold(ct, []byte("application/x-ndjson")), bytes.EqualFold(ct, []byte("application/jsonl")),
		bytes.EqualFold(ct, []byte("application/json-seq")):
		x.streamed, x.mode = true, parseLines
	default:
		x.mode = parseBody
	}
	x.rec.Stream = x.streamed
	if enc := resp.Header.ContentEncoding(); len(enc) > 0 && !bytes.EqualFold(enc, []byte("identity")) {
		// The compressed bytes pass through untouched; the parser reads a
		// decompressed copy.
		if x.dec = newSideDecoder(enc, x.parseDecoded); x.dec == nil {
			x.mode = parseNone
			x.rec.Partial = true
		}
	}
	if x.strip && (x.mode != parseSSE || x.dec != nil) {
		x.strip = false // only a plain SSE stream can have the chunk removed
	}
	max := x.snap.cfg.MaxEventBytes
	switch x.mode {
	case parseSSE:
		if x.parser == nil {
			x.parser = sse.NewParser(max)
		}
		x.parser.Reset()
	case parseLines:
		if x.lines == nil {
			x.lines = sse.NewLines(max)
		}
		x.lines.Reset()
	}
}

// pull reads the upstream once into b and feeds what it read to the
// parser. An upstream error is kept and returned again on every later call;
// when bytes came with it, they are returned first, without the error.
func (x *exchange) pull(b []byte) (int, error) {
	if x.readErr != nil {
		return 0, x.readErr
	}
	n, err := x.body.Read(b)
	if n > 0 {
		x.observe(b[:n], x.p.now())
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
	x.lastFlush = t
	if x.firstByteFlush.IsZero() {
		x.firstByteFlush = t
	}
	if x.chunkAnswers > 0 && x.firstAnswerFlush.IsZero() {
		x.firstAnswerFlush = t
	}
	x.chunkAnswers = 0
	for ; x.chunkTokens > 0; x.chunkTokens-- {
		if x.firstTokenFlush.IsZero() {
			x.firstTokenFlush = t
		} else {
			gap := t.Sub(x.lastTokenFlush)
			if len(x.gaps) < maxGaps {
				x.gaps = append(x.gaps, gap)
			}
			x.rec.ITLCount++
			x.rec.Series.ITL(gap)
		}
		x.lastTokenFlush = t
	}
}

// observe feeds one upstream read, read at t, to the parser (through the
// decompressor when the body is compressed).
func (x *exchange) observe(b []byte, t time.Time) {
	if x.firstByteRead.IsZero() {
		x.firstByteRead = t
	}
	if x.dec != nil {
		x.decAt = t
		x.dec.feed(b)
		return
	}
	x.parse(b, t)
}

// parseDecoded is the decompressor's sink; it runs while observe waits.
func (x *exchange) parseDecoded(b []byte) { x.parse(b, x.decAt) }

// parse reads body bytes read at t.
func (x *exchange) parse(b []byte, t time.Time) {
	switch x.mode {
	case parseSSE:
		if x.strip {
			x.parseStrip(b, t)
			return
		}
		x.parser.Feed(b)
		for x.parser.Next() {
			ev := x.parser.Event()
			if ev.Truncated {
				x.rec.Partial = true
			}
			x.apply(x.dialect.Event(ev.Type, ev.Data), t)
		}
	case parseLines:
		x.lines.Feed(b)
		for x.lines.Next() {
			if x.lines.Truncated() {
				x.rec.Partial = true
			}
			x.apply(x.dialect.Event(nil, x.lines.Line()), t)
		}
	case parseBody:
		if len(x.whole)+len(b) <= x.snap.cfg.MaxEventBytes {
			x.whole = append(x.whole, b...)
		} else {
			x.rec.Partial = true
			x.mode = parseNone
		}
	}
}

// parseStrip parses like parse and also leaves in x.stripped the bytes to
// relay: everything but the usage-only chunk that tokentap itself asked for
// (stream_options.include_usage injected into the request). Bytes of an
// event still incomplete are held back until it completes, so an event is
// relayed in the write of the read that completed it, as without stripping.
func (x *exchange) parseStrip(b []byte, t time.Time) {
	out := x.stripped[:0]
	start := 0
	x.parser.Feed(b)
	for x.parser.Next() {
		end := x.parser.Offset()
		ev := x.parser.Event()
		if ev.Truncated {
			x.rec.Partial = true
		}
		x.apply(x.dialect.Event(ev.Type, ev.Data), t)
		if !dialect.UsageOnly(ev.Data) {
			out = append(out, x.held...)
			out = append(out, b[start:end]...)
		}
		x.held = x.held[:0]
		start = end
	}
	rest := b[start:]
	switch {
	case !x.parser.Pending():
		// Between events (comments, blank lines): nothing to decide later.
		out = append(out, x.held...)
		out = append(out, rest...)
		x.held = x.held[:0]
	case len(x.held)+len(rest) > x.snap.cfg.MaxEventBytes:
		// An event too large to hold: stop stripping, relay as it comes.
		out = append(out, x.held...)
		out = append(out, rest...)
		x.held = x.held[:0]
		x.strip = false
	default:
		x.held = append(x.held, rest...)
	}
	x.stripped = out
}

func (x *exchange) apply(o dialect.Obs, t time.Time) {
	if o.Token {
		x.events++
		x.chunkTokens++
		if o.Answer {
			x.chunkAnswers++
		}
		if x.firstTokenRead.IsZero() {
			x.firstTokenRead = t
		}
	}
	if o.HasIn {
		x.usage.hasIn, x.usage.in = true, o.In
	}
	if o.HasOut {
		x.usage.hasOut, x.usage.out = true, o.Out
	}
	if o.Items > 0 {
		x.items = o.Items
	}
	if o.Timings.Set {
		x.timings = o.Timings
	}
	if o.Error {
		x.streamError = true
	}
}

// CloseWithError is called by the server once the response has been
// written (err == nil) or has failed (err is the write error, or the read
// error Read returned). It finishes the exchange.
func (x *exchange) CloseWithError(err error) error {
	x.finish(err)
	return nil
}

// finish ends the exchange exactly once: it settles the upstream connection,
// stops the peer watch, completes the record and hands it to the sinks.
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
	if x.watch != nil {
		x.watch.stop()
	}
	gone := x.cancel.isGone()

	// The outcome, upstream faults before client faults.
	switch {
	case rec.Outcome != metrics.OutcomeOK:
		// Set by fail.
	case gone:
		rec.Outcome, rec.Error = metrics.OutcomeClientCancel, "client closed the connection"
	case x.readErr != nil && x.readErr != io.EOF:
		if isTimeout(x.readErr) {
			rec.Outcome = metrics.OutcomeUpstreamTimeout
		} else {
			rec.Outcome = metrics.OutcomeUpstreamError
		}
		rec.Error = "upstream stream broken: " + x.readErr.Error()
	case writeErr != nil || (x.body != nil && !complete):
		rec.Outcome = metrics.OutcomeClientCancel
		if writeErr != nil {
			rec.Error = "cannot write to client: " + writeErr.Error()
		}
	case rec.Status >= 500 || x.streamError:
		rec.Outcome = metrics.OutcomeUpstreamError
		if x.streamError {
			rec.Error = "error reported inside the response"
		}
	}

	// The upstream connection goes back to the pool only after a complete,
	// clean response; anything else closes it, which also cancels the
	// request at the backend.
	if x.conn != nil {
		x.cancel.detach()
		_ = x.resp.CloseBodyStream()
		if complete && rec.Outcome != metrics.OutcomeClientCancel && !x.resp.ConnectionClose() {
			x.route.up.put(x.conn)
		} else {
			x.route.up.discard(x.conn)
		}
		x.conn = nil
	}

	if x.dec != nil {
		if !x.dec.close() && complete {
			rec.Partial = true // the copy did not decode; the relay was unaffected
		}
		x.dec = nil
	}
	if x.mode == parseBody && complete && len(x.whole) > 0 {
		o := x.dialect.Body(x.whole)
		o.Token, o.Answer = false, false
		x.apply(o, now)
		if x.streamError && rec.Outcome == metrics.OutcomeOK {
			rec.Outcome, rec.Error = metrics.OutcomeUpstreamError, "error reported inside the response"
		}
	}
	x.fillRecord(now)
	x.releaseTicket()
	if x.client != nil {
		rec.ClientRTT = clientRTT(x.client, now)
	}
	x.snap.metrics.Observe(rec)
	for _, s := range x.p.opts.Sinks {
		s.Observe(rec)
	}
	x.p.releaseExchange(x)
}

// fillRecord derives the record's timings from the clock marks.
func (x *exchange) fillRecord(now time.Time) {
	rec := &x.rec
	if x.lastFlush.IsZero() {
		rec.E2E = now.Sub(x.arrival)
	} else {
		rec.E2E = x.lastFlush.Sub(x.arrival)
	}
	rec.BytesOut = x.bytesOut
	rec.Events = x.events
	if x.usage.hasIn {
		rec.InputTokens = x.usage.in
	}
	switch {
	case x.usage.hasOut:
		rec.OutputTokens, rec.TokensSource = x.usage.out, "usage"
	case x.streamed && x.events > 0:
		rec.OutputTokens, rec.TokensSource = x.events, "counted"
	}
	if x.items > 0 {
		rec.Items = x.items
	}
	if t := x.timings; t.Set {
		rec.ServerQueue, rec.ServerLoad, rec.ServerPrefill, rec.ServerDecode = t.Queue, t.Load, t.Prefill, t.Decode
	}
	if x.written.IsZero() {
		rec.UpstreamTTFB = metrics.Absent
	}
	if x.streamed && !x.firstAnswerFlush.IsZero() {
		rec.TTFA = x.firstAnswerFlush.Sub(x.arrival)
	}
	if x.streamed && !x.firstTokenFlush.IsZero() {
		rec.TTFT = x.firstTokenFlush.Sub(x.arrival)
		if rec.OutputTokens > 1 {
			rec.TPOT = (rec.E2E - rec.TTFT) / time.Duration(rec.OutputTokens-1)
		}
	}
	if n := len(x.gaps); n > 0 {
		var sum, maxGap time.Duration
		for _, g := range x.gaps {
			sum += g
			maxGap = max(maxGap, g)
		}
		slices.Sort(x.gaps)
		rec.ITLMean = sum / time.Duration(n)
		rec.ITLP50 = x.gaps[(n-1)/2]
		rec.ITLP99 = x.gaps[(n-1)*99/100]
		rec.ITLMax = maxGap
	}
	if !x.written.IsZero() {
		o := x.written.Sub(x.arrival) - max(rec.Queue, 0)
		switch {
		case !x.firstTokenFlush.IsZero():
			o += x.firstTokenFlush.Sub(x.firstTokenRead)
		case !x.firstByteFlush.IsZero():
			o += x.firstByteFlush.Sub(x.firstByteRead)
		}
		rec.Overhead = o
	}
}

// cancelState ties the exchange's upstream connection to the peer watch:
// when the client goes, the connection is closed, which interrupts any
// read or write on it and cancels the request at the backend; a request
// waiting for admission sees done closed.
type cancelState struct {
	mu   sync.Mutex
	gone bool
	conn net.Conn
	done chan struct{}
}

// doneChan returns a channel closed when the client has gone.
func (c *cancelState) doneChan() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.gone {
			close(c.done)
		}
	}
	return c.done
}

// attach makes conn the one to close on cancel; false if already cancelled.
func (c *cancelState) attach(conn net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone {
		return false
	}
	c.conn = conn
	return true
}

func (c *cancelState) detach() {
	c.mu.Lock()
	c.conn = nil
	c.mu.Unlock()
}

// fire is called by the peer watch when the client has gone.
func (c *cancelState) fire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.gone && c.done != nil {
		close(c.done)
	}
	c.gone = true
	if c.conn != nil {
		_ = c.conn.Close()
	}
}

func (c *cancelState) isGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone
}
