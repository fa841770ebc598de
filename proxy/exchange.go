package proxy

import (
	"bytes"
	"io"
	"net"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/relay"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// exchange is one request in flight: its life (serve, route, admit,
// refuse, respond, finish) and its record. What it does on the way is
// done by its parts, each a type with its reset (kept) and its owner:
//
//	in     inbound          the client's request (request.go)
//	att    upstreamAttempt  the attempts and failover (attempt.go, failover.go)
//	tap    measure.Tap      parsing and measuring, no I/O (proxy/measure)
//	relay  relay.Body       every path of the body to the client (relay.go,
//	                        passloop.go); the server's body stream
//	cs     measure.ClientSide  the delivery on the client connection, and
//	                        the wait for its acknowledgement (proxy/measure)
//
// Hand-overs: the connection's goroutine runs ServeHTTP and, through the
// relay, the body and finish (fasthttp calls Read, WriteTo and
// CloseWithError on it); a relay loop holds the relay and the tap while
// the stream is in it (passLoop waits on its channel); the peer watch
// touches only cancel; after finish a record that waits for the client's
// acknowledgement belongs to the proxy's ackWatch (the cs part), a
// compressed body's to its own goroutine; a shadow copy is an exchange of
// its own on its own goroutine.
type exchange struct {
	p    *Proxy
	snap *snapshot
	rec  metrics.Record
	id   []byte

	rt      *route
	dialect dialect.Dialect
	client  net.Conn
	watch   downstream.Watch
	cancel  downstream.Cancel
	fire    func() // cancel.fire, made once per pooled exchange

	in    inbound            // the client's request: its path, body, stream flag (request.go)
	att   upstreamAttempt    // the attempts against the route's upstreams (attempt.go)
	tap   measure.Tap        // what the body is, how it is parsed and measured (proxy/measure)
	relay relay.Body         // the body's way to the client (proxy/relay)
	cs    measure.ClientSide // the response's delivery to the client connection (proxy/measure)
	fin   finishing          // what finish knew, while the record waits (ackWatch)

	// Admission control.
	tenant    string
	ticket    *ratelimit.Ticket
	estIn     int64          // estimated input tokens
	charge    measure.Charge // how it is priced (proxy/measure): by the request's model, then the served one
	modelIdx  int            // the model's metric index
	responded bool           // the upstream answered with headers
	finished  bool
	shadow    bool // a copy sent to the route's shadow upstream (shadow.go)
}

// --- The request path, step by step (ServeHTTP runs serve). ---

// serve runs the request's steps in order; the first that refuses ends it,
// and its refusal is answered and recorded by refuse, the one place that
// does so. After relay the server reads the body through the exchange.
func (x *exchange) serve(ctx *fasthttp.RequestCtx) *refusal {
	if r := x.pickRoute(ctx); r != nil {
		return r
	}
	upgrade := isWebSocketUpgrade(&ctx.Request.Header)
	if upgrade && !x.rt.WebSocket {
		return refuseUpgrade
	}
	if !x.in.late { // judged on the headers alone
		if r := x.overload(ctx, false); r != nil {
			return r
		}
	}
	if r := x.readRequest(ctx); r != nil {
		return r
	}
	if whole := !x.in.stream && ctx.IsPost(); x.in.late || whole { // its upstream known from its body, or its body says it is no stream
		if r := x.overload(ctx, whole); r != nil {
			return r
		}
	}
	// From here on a client that goes away cancels the request, queued or
	// upstream.
	x.client = ctx.Conn()
	x.cs.Start(wireOf(x.client))
	x.watch.Start(x.client, x.fire, &x.p.loops)
	if r := x.admit(); r != nil {
		return r
	}
	if upgrade {
		return x.att.upgrade(ctx) // a tunnel (upgrade.go)
	}
	if r := x.att.forward(ctx); r != nil {
		return r
	}
	x.respond(ctx)
	return nil
}

// pickRoute checks what the headers say and finds the request's route, dialect
// and tenant, before a byte of the body is read: a refused request costs no
// more than its headers.
func (x *exchange) pickRoute(ctx *fasthttp.RequestCtx) *refusal {
	rec, snap := &x.rec, x.snap
	rawPath := ctx.Request.Header.RequestURI()
	if i := bytes.IndexByte(rawPath, '?'); i >= 0 {
		rawPath, x.in.query = rawPath[:i], rawPath[i:]
	}
	if r := checkRequest(ctx); r != nil {
		rec.Path = boundedString(rawPath, maxLoggedPath)
		return r
	}
	path, err := routing.NormalizePath(x.in.path[:0], rawPath)
	if err != nil {
		rec.Path = boundedString(rawPath, maxLoggedPath)
		return refusePath
	}
	x.in.path = path
	rec.Path = boundedString(path, maxLoggedPath)

	r := snap.match(path)
	if r == nil {
		return refuseNoRoute
	}
	x.rt = r
	rec.Route = r.Name
	rec.Series = snap.metrics.Series(r.set.Members()[0].Row, snap.metrics.OtherIndex())
	x.dialect = r.dialect
	if x.dialect == nil {
		x.dialect = dialect.ForPath(path)
	}
	rec.Dialect = x.dialect.Name()

	if snap.admit != nil {
		tenant, ok := admission.Identify(snap.admit, &ctx.Request.Header)
		if !ok {
			rec.Tenant = "unknown"
			return refuseKey
		}
		x.tenant, rec.Tenant = tenant, tenant
		rec.TenantSeries = snap.metrics.Tenant(tenant)
	}
	if r.late() {
		// The body says which route (its model) or upstream (its input).
		x.in.late = true
		return nil
	}
	x.pickUpstream(r, &ctx.Request.Header)
	return nil
}

// readRequest reads the body and what it says: the model (the metric
// series), whether it streams, how many items it holds.
func (x *exchange) readRequest(ctx *fasthttp.RequestCtx) *refusal {
	rec, snap := &x.rec, x.snap
	body, r := x.in.readBody(ctx, x.p.opts.MaxRequestBodySize, x.p)
	rec.BytesIn = int64(len(body))
	if r != nil {
		return r
	}
	// A request whose bytes came in over time (a slow upload, a large
	// body) kept tokentap waiting for the client: that is not overhead.
	if cc := downstream.Of(ctx.Conn()); cc != nil && cc.Rx() != 0 {
		x.tap.Uploaded(sock.Received(cc.Rx(), x.p.now(), x.p.opts.RequestReadTimeout))
	}
	x.in.body0 = body
	x.in.encoded = measure.Encoded(ctx.Request.Header.ContentEncoding())
	req := x.dialect.Request(x.in.path, body)
	if req.Dup != "" {
		return x.duplicateMember(req.Dup)
	}
	model := req.Model
	rec.Model = boundedString(model, maxLoggedModel)
	if x.in.late {
		if r := x.pickLate(string(model), &ctx.Request.Header); r != nil {
			return r
		}
	}
	x.charge = x.chargeFor(rec.Model)
	rec.Stream = req.Stream
	x.in.stream = req.Stream
	x.tap.Items(req.Items)
	if x.tap.Details() {
		rec.MaxTokens = dialect.MaxOutputTokens(body)
	}
	x.modelIdx = snap.metrics.ModelIndex(x.att.mem.Row, model)
	rec.Series = snap.metrics.Series(x.att.mem.Row, x.modelIdx)
	x.tap.Live(rec.Series)
	if snap.cfg.EnforceModels && len(model) > 0 && !snap.metrics.Allowed(model) {
		return refuseModel
	}
	rec.Queue = 0
	return nil
}

// respond passes the response headers on and hands the body to the server,
// which reads it through the exchange (WriteTo, Read) and then calls
// CloseWithError.
func (x *exchange) respond(ctx *fasthttp.RequestCtx) {
	rec, resp := &x.rec, x.att.resp
	x.responded = true
	rec.Status = resp.StatusCode()
	if hr, ok := x.dialect.(dialect.HeaderReader); ok {
		if t := hr.Header(resp.Header.Peek); t.Set {
			x.tap.Timings(t)
		}
	}
	upstream.CopyResponseHeader(resp, &ctx.Response.Header, x.id)
	x.p.keepAlive(ctx)
	if x.ticket != nil {
		admission.SetQuotaHeaders(&ctx.Response.Header, x.snap.admit, x.tenant, x.rt.Name)
	}
	body := resp.BodyStream()
	if body == nil {
		// No body (HEAD, 204, 304): the exchange is over.
		x.relay.NoBody(0)
		if ctx.IsHead() {
			ctx.Response.SkipBody = true
		}
		x.Finish(nil)
		return
	}
	x.startParsing(resp)
	cl := resp.Header.ContentLength()
	if x.tap.Streamed() || cl < 0 {
		// Unknown length: chunked to the client, each upstream read flushed
		// as its own chunk. A known length would make fasthttp buffer until
		// 4 KiB are ready, holding back the first events.
		cl = -1
		// Headers go out at once, so a client sees them during a long
		// prefill; when body bytes came with them, they go out together
		// with the first chunk instead, in one write.
		ctx.Response.ImmediateHeaderFlush = x.att.conn.Buffered() == 0
		// A stream may run for minutes; no attempt sends the body again.
		x.in.letBodyGo(x.p)
		x.att.letRequestGo()
	}
	x.relay.Start(body, x.att.conn, x.client, cl)
	if resp.Header.ContentLength() == -1 && ctx.Request.Header.IsHTTP11() && !x.tap.Stripping() && isPlain(x.client) {
		// Chunked in, chunked out, on a plain connection: tokentap writes
		// the response itself, the framing as it came (servePass,
		// passChunks). Over TLS the server writes it (the body stream).
		x.relay.ServePass(ctx, resp)
		return
	}
	if cl < 0 && !ctx.Request.Header.IsHTTP11() {
		x.relay.ServeHTTP10(ctx)
		return
	}
	ctx.Response.SetBodyStream(&x.relay, cl)
}

// refuse answers a request tokentap refuses itself, with a short JSON error
// in tokentap's words (never a header value, an upstream's bytes or an
// address), and finishes the record. It is the one place that does.
func (x *exchange) refuse(ctx *fasthttp.RequestCtx, r *refusal) {
	rec := &x.rec
	rec.Status, rec.Outcome, rec.Error = r.status, r.outcome, r.msg
	if r.note != "" {
		rec.Error = r.note
	}
	switch {
	case r.status == 499:
		// Nobody is listening: close without writing (nginx logs 499 and
		// writes nothing). A hijack without a response is fasthttp's way
		// to write nothing; the connection closes when it returns.
		ctx.SetConnectionClose()
		ctx.Response.SetStatusCode(r.status)
		ctx.HijackSetNoResponse(true)
		ctx.Hijack(func(c net.Conn) { _ = c.Close() })
	default:
		if r.errType != "" {
			writeErrorBody(ctx, r.status, r.errType, r.code, r.msg, x.id, r.anthropic)
		} else {
			writeJSONError(ctx, r.status, r.code, r.msg, x.id)
		}
		if r.close {
			// The body was not read: close rather than drain it.
			ctx.SetConnectionClose()
		}
		x.p.keepAlive(ctx)
		if r.allow != "" {
			ctx.Response.Header.Set("Allow", r.allow)
		}
		if r.rateLimited || r.retryAfter > 0 {
			secs := int64((r.retryAfter + time.Second - 1) / time.Second)
			ctx.Response.Header.Set("Retry-After", strconv.FormatInt(max(secs, 1), 10))
		}
		if r.rateLimited {
			admission.SetQuotaHeaders(&ctx.Response.Header, x.snap.admit, x.tenant, x.rt.Name)
		}
	}
	x.Finish(nil)
}

// --- Measuring the body on the way (the tap, proxy/measure). ---

// startParsing chooses how the body is measured from its Content-Type and
// Content-Encoding (Tap.Start).
func (x *exchange) startParsing(resp *fasthttp.Response) {
	x.tap.Start(resp.Header.ContentType(), resp.Header.ContentEncoding(), x.dialect, x.snap.cfg.MaxEventBytes, x.snap.cfg.MaxDecodedBytes,
		x, len(x.snap.cfg.Prices) > 0)
	x.rec.Stream = x.tap.Streamed()
}

// Observe feeds one upstream read, read at t, to the tap.
func (x *exchange) Observe(b []byte, t time.Time) { x.tap.Read(b, t) }

// --- The end. ---

// Finish ends the exchange exactly once: it settles the upstream
// connection and stops the peer watch at once, then completes the record
// and hands it to the sinks. For a compressed response the record is
// completed on a goroutine of its own once the side decoder has decoded
// what it was given, and once the client acknowledged the response's last
// bytes (or about two round trips passed), so the end of the response
// never waits for either.
func (x *exchange) Finish(writeErr error) {
	if x.finished {
		return
	}
	x.finished = true
	if x.in.bodyHeld > 0 {
		// The body was sent (or never will be): out of the budget.
		x.p.bodies.Add(-x.in.bodyHeld)
		x.in.bodyHeld = 0
	}
	now := x.p.now()
	x.att.uncount()

	complete := x.relay.End(now, writeErr)
	x.watch.Stop()
	gone := x.cancel.IsGone()

	// The upstream connection goes back to the pool only after a complete,
	// clean response; anything else closes it, which also cancels the
	// request at the backend.
	if x.att.conn != nil {
		x.cancel.Detach()
		_ = x.att.resp.CloseBodyStream()
		switch {
		case x.relay.Stray():
			metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
			x.att.up.Discard(x.att.conn)
		case complete && !gone && writeErr == nil && !x.att.resp.ConnectionClose():
			x.att.up.Put(x.att.conn, x.att.resp.Header.ContentLength() < 0)
		default:
			x.att.up.Discard(x.att.conn)
		}
		x.att.conn = nil
	}
	wait := false
	if x.client != nil {
		ti := x.p.takeInfo()
		wait = x.cs.Ended(writeErr == nil && !gone, now, &x.p.clientAcks, !x.p.opts.NoClientSide, ti)
		x.p.infos.Put(ti)
		if cc := downstream.Of(x.client); cc != nil {
			cc.ExpectHead() // the next bytes begin the next request
		}
		x.client = nil
	}
	// The record is made later, with what finish knew now (recordEnd),
	// when it waits for the side decoder or the client's ACK.
	x.fin = finishing{now, writeErr, gone, complete}
	if x.tap.Decoding() {
		go x.recordLater(wait)
		return
	}
	x.accountBody(now, complete)
	if wait {
		x.p.waiting.add(x)
		return
	}
	x.recordEnd()
}

// finishing is what finish knew, kept for a record made later (recordLater,
// ackWatch).
type finishing struct {
	now            time.Time
	writeErr       error
	gone, complete bool
}

// recordEnd records with what finish kept in x.fin.
func (x *exchange) recordEnd() {
	e := x.fin
	x.fin = finishing{}
	x.record(e.now, e.writeErr, e.gone, e.complete)
}

// recordLater records once the side decoder is done and, with wait, the
// client acknowledged the response (or the wait ran out).
func (x *exchange) recordLater(wait bool) {
	x.accountBody(x.fin.now, x.fin.complete) // once the decoder is done, before the wait
	if wait {
		x.cs.Await(x.p.now)
	}
	x.recordEnd()
}

// record completes the record: what the body said, the outcome, the
// timings; then the sinks, and the exchange goes back to the pool.
func (x *exchange) record(now time.Time, writeErr error, gone, complete bool) {
	rec := &x.rec
	// Everything the body says is known (accountBody) before the outcome
	// is decided.

	// The outcome, upstream faults before client faults. Error texts are
	// tokentap's words: no address, no upstream bytes.
	switch {
	case rec.Outcome != metrics.OutcomeOK:
		// Set by refuse.
	case x.p.cutting.Load() && (gone || writeErr != nil || !complete):
		rec.Outcome, rec.Error = metrics.OutcomeShutdown, "cut at shutdown: the drain timeout ran out"
	case gone:
		rec.Outcome, rec.Error = metrics.OutcomeClientCancel, "client closed the connection"
	case x.relay.ReadErr() != nil && x.relay.ReadErr() != io.EOF:
		if sock.IsTimeout(x.relay.ReadErr()) {
			rec.Outcome = metrics.OutcomeUpstreamTimeout
		} else {
			rec.Outcome = metrics.OutcomeUpstreamError
		}
		rec.Error = "upstream stream broken: " + describeStreamError(x.relay.ReadErr())
	case x.relay.Started() && !complete && writeErr == nil && x.relay.Fixed():
		rec.Outcome, rec.Error = metrics.OutcomeUpstreamError, "the upstream response ended before its Content-Length"
	case writeErr != nil || (x.relay.Started() && !complete):
		rec.Outcome = metrics.OutcomeClientCancel
		if writeErr != nil {
			rec.Error = "cannot write to client: " + describeStreamError(writeErr)
		}
	case rec.Status >= 500 || x.tap.StreamError():
		rec.Outcome = metrics.OutcomeUpstreamError
		if x.tap.StreamError() {
			rec.Error = "error reported inside the response"
		}
	}

	x.fillRecord(now)
	x.cs.Fill(&x.rec, x.tap.Arrival())
	if !x.shadow {
		// A copy counts in its upstream's /stats group and the access
		// log only: never in goodput, the route's series or its guard.
		x.judge()
		x.snap.metrics.Observe(rec)
	}
	if !x.p.opts.NoStats {
		x.p.stats.Observe(rec, x.tap.Gaps())
	}
	x.learnEnd(complete)
	if m := x.att.mem; m != nil && rec.Attempts > 0 {
		if rec.CachedTokens >= 0 {
			m.Cache.Note(rec.CachedTokens, rec.TTFT.Microseconds())
		}
		if m.Scrape != nil && rec.Outcome == metrics.OutcomeOK && rec.E2E > 0 {
			m.NoteSlot(rec.E2E - max(rec.Queue, 0))
		}
	}
	if x.rt != nil && !x.shadow {
		x.rt.set.Guarded(x.att.mem, rec, x.in.stickyKey, x.in.stickyKeyed, x.p.statsNow, x.p.log)
	}
	for _, s := range x.p.opts.Sinks {
		if g, ok := s.(metrics.GapSink); ok {
			g.ObserveGaps(rec, x.tap.Gaps())
			continue
		}
		s.Observe(rec)
	}
	if !x.shadow {
		x.p.inflight.Add(-1)
	}
	x.p.releaseExchange(x)
}

// accountBody makes everything the body says known to the tap: what the
// side decoder has left of a compressed body (once it is done), and a
// complete body read whole (not streamed): its usage, its error. Then the
// admission ticket goes back with the tokens used: before the record,
// which may wait a round trip for the client's ACK, or a client that sends
// its next request as soon as a response ended would find its own slot
// still taken. Called once per exchange, before record.
func (x *exchange) accountBody(now time.Time, complete bool) {
	x.tap.Settle(now, complete)
	x.tap.CheckUsage(x.rec.BytesIn, x.in.encoded, x.relay.BytesOut(), now)
	if len(x.tap.Model()) > 0 && x.rt != nil {
		// Priced as the model that served it.
		x.charge = x.chargeFor(string(x.tap.Model()))
	}
	x.releaseTicket()
}

// fillRecord derives the record's timings from the tap.
func (x *exchange) fillRecord(now time.Time) {
	x.rec.BytesOut = x.relay.BytesOut()
	x.tap.Fill(&x.rec, now)
	if x.att.up != nil {
		x.rec.UpstreamAddr = x.att.up.Addr()
	}
	if x.rt != nil {
		in := x.tap.InputTokens(x.rec.BytesIn)
		x.rec.Class = x.snap.cfg.Classes.Of(in, x.rec.OutputTokens, x.rec.CachedTokens)
	}
	measure.PriceRecord(&x.rec, x.charge, &x.tap, len(x.snap.cfg.Prices) > 0)
}

// judge judges the finished record against its route's SLO, under the
// tenant's overrides.
func (x *exchange) judge() {
	if x.rt == nil {
		return
	}
	slo := x.slo()
	slo.Judge(&x.rec)
}
