package proxy

import (
	"bytes"
	"net"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// The exchange's steps in the order a request lives them (ServeHTTP runs
// serve): its headers checked and its route found (pickRoute), its body
// read (readRequest), its upstream chosen and its admission and overload
// judged (steer.go), its attempts (forward.go) or its tunnel (upgrade.go),
// and its response passed on (respond); a step that refuses is answered
// by refuse. The end is finish.go's.

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
	x.startClientSide()
	x.watch.Start(x.client, x.fire, &x.p.loops)
	if r := x.admit(); r != nil {
		return r
	}
	if upgrade {
		return x.upgrade(ctx) // a tunnel (upgrade.go)
	}
	x.rt.shadow.start(x, ctx) // a sampled copy to the shadow upstream, on its own goroutine
	if r := x.forward(ctx); r != nil {
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
		ctx.Response.ImmediateHeaderFlush = x.att.conn == nil || x.att.conn.Buffered() == 0
		// A stream may run for minutes; no attempt sends the body again.
		x.in.letBodyGo(x.p)
		x.att.letRequestGo()
	}
	x.relay.Start(body, x.att.conn, x.client, cl)
	if resp.Header.ContentLength() == -1 && ctx.Request.Header.IsHTTP11() && !x.tap.Stripping() && isPlain(x.client) && x.att.conn != nil {
		// Chunked in, chunked out, on a plain connection: tokentap writes
		// the response itself, the framing as it came (servePass,
		// passChunks). Over TLS, and from an h2c backend, the server
		// writes it (the body stream).
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

// checkRequest refuses what the request line and headers alone make
// unsafe to relay.
func checkRequest(ctx *fasthttp.RequestCtx) *refusal {
	h := &ctx.Request.Header
	switch {
	case !bytes.Equal(h.Protocol(), strHTTP11) && !bytes.Equal(h.Protocol(), strHTTP10):
		return refuseVersion
	case !upperToken(h.Method()):
		// Methods are case-sensitive (RFC 9110 §9.1): "get" is no GET, and
		// an upstream may read it as one. nginx answers 400.
		return refuseMethodCase
	case hasFold(h.RawHeaders()):
		// A folded header line (obs-fold, RFC 9112 §5.2): refused, as
		// nginx does; read differently by different servers.
		return refuseFold
	case ctx.IsConnect() || ctx.IsTrace():
		// TRACE would echo the request, credentials included; CONNECT
		// would open a tunnel. Neither is an inference call.
		return refuseMethod
	case !validHeaderNames(&ctx.Request.Header):
		return refuseHeaderName
	case ctx.Request.Header.ContentLength() == -1 && hasContentLength(ctx.Request.Header.RawHeaders()):
		// Both framings (RFC 9112 §6.3): what an upstream or a proxy
		// before tokentap made of the body is unknowable. A smuggling try.
		return refuseFraming
	}
	return nil
}

var (
	strHTTP11 = []byte("HTTP/1.1")
	strHTTP10 = []byte("HTTP/1.0")
)

// upperToken reports whether a method is upper-case letters (and - or _).
func upperToken(m []byte) bool {
	for _, c := range m {
		if (c < 'A' || c > 'Z') && c != '-' && c != '_' {
			return false
		}
	}
	return len(m) > 0
}

// hasFold reports a folded (continued) header line among raw headers.
func hasFold(raw []byte) bool {
	for {
		i := bytes.IndexByte(raw, '\n')
		if i < 0 || i+1 >= len(raw) {
			return false
		}
		if raw[i+1] == ' ' || raw[i+1] == '\t' {
			return true
		}
		raw = raw[i+1:]
	}
}

// validHeaderNames reports whether every header name is an RFC 9110 token:
// a name with a space or a colon in it could be read differently by the
// upstream ("Transfer-Encoding x: chunked").
func validHeaderNames(h *fasthttp.RequestHeader) bool {
	for k := range h.All() {
		if len(k) == 0 {
			return false
		}
		for _, c := range k {
			if !conf.TokenChar(c) {
				return false
			}
		}
	}
	return true
}

// hasContentLength reports a Content-Length field among raw request
// headers.
func hasContentLength(raw []byte) bool {
	const name = "content-length:"
	for len(raw) > 0 {
		line := raw
		if i := bytes.IndexByte(raw, '\n'); i >= 0 {
			line, raw = raw[:i], raw[i+1:]
		} else {
			raw = nil
		}
		if len(line) >= len(name) && bytes.EqualFold(line[:len(name)], []byte(name)) {
			return true
		}
	}
	return false
}
