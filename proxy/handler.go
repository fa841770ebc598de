package proxy

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// ServeHTTP relays one request. See the package comment for its journey.
func (p *Proxy) ServeHTTP(ctx *fasthttp.RequestCtx) {
	snap := p.snap.Load()
	x := p.acquireExchange(snap, p.arrival(ctx))
	rec := &x.rec
	rec.Series, rec.Route = snap.metrics.Unmatched(), metrics.UnmatchedRoute

	x.id = p.requestID(x.id[:0], ctx.Request.Header.Peek("X-Request-Id"))
	rec.RequestID = string(x.id)
	rec.Method = methodString(ctx.Method())
	uri := ctx.Request.Header.RequestURI()
	rawPath := uri
	if i := bytes.IndexByte(rawPath, '?'); i >= 0 {
		rawPath, x.query = rawPath[:i], rawPath[i:]
	}
	rec.Path = boundedString(rawPath, maxLoggedPath)
	if ctx.IsConnect() || ctx.IsTrace() {
		// TRACE would echo the request, credentials included; CONNECT
		// would open a tunnel. Neither is an inference call.
		ctx.Response.Header.Set("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
		p.failEarly(ctx, x, fasthttp.StatusMethodNotAllowed, "method_not_allowed", "this method is not relayed")
		return
	}
	if !validHeaderNames(&ctx.Request.Header) {
		p.failEarly(ctx, x, fasthttp.StatusBadRequest, "invalid_header", "a header name is not a valid token")
		return
	}
	if ctx.Request.Header.ContentLength() == -1 && hasContentLength(ctx.Request.Header.RawHeaders()) {
		// Both framings (RFC 9112 §6.3): what an upstream or a proxy
		// before tokentap made of the body is unknowable. A smuggling try.
		p.failEarly(ctx, x, fasthttp.StatusBadRequest, "ambiguous_framing", "the request has both Content-Length and Transfer-Encoding")
		return
	}
	path, err := normalizePath(x.path[:0], rawPath)
	if err != nil {
		p.failEarly(ctx, x, fasthttp.StatusBadRequest, "invalid_path", "the request path cannot be normalised")
		return
	}
	x.path = path
	rec.Path = boundedString(path, maxLoggedPath)

	r := snap.match(path)
	if r == nil {
		p.failEarly(ctx, x, fasthttp.StatusNotFound, "no_route", "no route matches this path")
		return
	}
	x.route = r
	rec.Route = r.Name
	rec.Series = snap.metrics.Series(r.index, snap.metrics.OtherIndex())
	x.dialect = r.dialect
	if x.dialect == nil {
		x.dialect = dialect.ForPath(path)
	}
	rec.Dialect = x.dialect.Name()

	// The tenant comes from the headers, before a byte of the body is
	// read: an unknown key costs no more than its headers.
	if snap.admit != nil {
		tenant, ok := identify(snap.admit, &ctx.Request.Header)
		if !ok {
			rec.Tenant = "unknown"
			rec.Outcome = metrics.OutcomeRejected
			p.failEarly(ctx, x, fasthttp.StatusUnauthorized, "invalid_api_key", "unknown or missing API key")
			return
		}
		x.tenant, rec.Tenant = tenant, tenant
		rec.TenantSeries = snap.metrics.Tenant(tenant)
	}

	body, f := x.readBody(ctx, p.opts.MaxRequestBodySize)
	rec.BytesIn = int64(len(body))
	if f != nil {
		ctx.SetConnectionClose()
		p.fail(ctx, x, f.status, f.outcome, f.code, f.msg)
		return
	}
	req := x.dialect.Request(path, body)
	model := req.Model
	rec.Model = boundedString(model, maxLoggedModel)
	rec.Stream = req.Stream
	x.m.items = req.Items
	rec.Series = snap.metrics.Series(r.index, snap.metrics.ModelIndex(model))
	x.m.live = rec.Series
	if snap.cfg.EnforceModels && len(model) > 0 && !snap.metrics.Allowed(model) {
		p.fail(ctx, x, fasthttp.StatusBadRequest, metrics.OutcomeBadRequest, "model_not_allowed", "this model is not served here")
		return
	}
	rec.Queue = 0

	// From here on a client that goes away cancels the request, queued or
	// upstream.
	x.client = ctx.Conn()
	x.watch.start(x.client, x.fire)
	if snap.admit != nil && !p.admit(ctx, x, body) {
		return
	}

	x.scratch = prepareRequest(ctx, x.req, r, x.path, x.query, body, x.id, x.scratch)
	x.req.Header.Del(tenantHeader)
	if x.tenant != "" {
		x.req.Header.Set(tenantHeader, x.tenant)
	}
	if r.InjectUsage && x.dialect == dialect.OpenAI && req.Stream {
		if b, ok := dialect.InjectIncludeUsage(x.injected[:0], body); ok {
			// The one case where tokentap changes bytes: the upstream is
			// asked for usage, and the usage chunk it adds is removed from
			// the stream. Compression is declined so the chunk can be found.
			x.injected = b
			x.req.SetBodyRaw(b)
			x.req.Header.Del("Accept-Encoding")
			x.strip = true
		}
	}
	head := ctx.IsHead()
	err = x.roundTrip(head)
	if err != nil {
		switch {
		case x.cancel.isGone():
			p.fail(ctx, x, 499, metrics.OutcomeClientCancel, "", "client closed the connection")
		case isTimeout(err):
			p.fail(ctx, x, fasthttp.StatusGatewayTimeout, metrics.OutcomeUpstreamTimeout, "upstream_timeout", describeUpstreamError(err))
		default:
			p.fail(ctx, x, fasthttp.StatusBadGateway, metrics.OutcomeUpstreamError, "upstream_unavailable", describeUpstreamError(err))
		}
		return
	}

	resp := x.resp
	x.responded = true
	rec.Status = resp.StatusCode()
	if hr, ok := x.dialect.(dialect.HeaderReader); ok {
		if t := hr.Header(resp.Header.Peek); t.Set {
			x.m.timings = t
		}
	}
	copyResponseHeader(resp, &ctx.Response.Header, x.id)
	if x.ticket != nil {
		setQuotaHeaders(&ctx.Response.Header, snap.admit, x.tenant, r.Name)
	}
	body0 := resp.BodyStream()
	if body0 == nil {
		// No body (HEAD, 204, 304): the exchange is over.
		x.upDone = true
		if head {
			ctx.Response.SkipBody = true
		}
		x.finish(nil)
		return
	}
	x.body = body0
	x.startParsing(resp)
	cl := resp.Header.ContentLength()
	if x.streamed || cl < 0 {
		// Unknown length: chunked to the client, each upstream read flushed
		// as its own chunk. A known length would make fasthttp buffer until
		// 4 KiB are ready, holding back the first events.
		cl = -1
		// Headers go out at once, so a client sees them during a long
		// prefill; when body bytes came with them, they go out together
		// with the first chunk instead, in one write.
		ctx.Response.ImmediateHeaderFlush = x.conn.br.Buffered() == 0
	}
	x.contentLength = cl
	if cl < 0 && !ctx.Request.Header.IsHTTP11() {
		x.serveHTTP10(ctx)
		return
	}
	ctx.Response.SetBodyStream(x, cl)
}

// Bounds on client-supplied strings in records and logs.
const (
	maxLoggedPath  = 512
	maxLoggedModel = 128
	maxRequestID   = 128
)

// boundedString copies at most n bytes of b, marking a cut with "…".
func boundedString(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "…"
}

// requestID returns the client's X-Request-Id when it is short and made of
// safe characters (letters, digits, "-", "_", ".", ":"), so that the value
// echoed, forwarded and logged is the same; otherwise a new id.
func (p *Proxy) requestID(dst, client []byte) []byte {
	if len(client) == 0 || len(client) > maxRequestID {
		return p.newRequestID(dst)
	}
	for _, c := range client {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return p.newRequestID(dst)
		}
	}
	return append(dst, client...)
}

// validHeaderNames reports whether every header name is an RFC 9110 token:
// a name with a space or a colon in it could be read differently by the
// upstream ("Transfer-Encoding x: chunked").
func validHeaderNames(h *fasthttp.RequestHeader) bool {
	ok := true
	for k := range h.All() {
		if !ok {
			break
		}
		if len(k) == 0 {
			ok = false
		}
		for _, c := range k {
			if !tchar[c] {
				ok = false
				break
			}
		}
	}
	return ok
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

// tchar marks the characters of an RFC 9110 token.
var tchar = func() (t [256]bool) {
	for c := 0; c < 256; c++ {
		t[c] = 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", byte(c)) >= 0
	}
	return t
}()

// methodString returns the method as a string, without allocating for the
// common ones.
func methodString(m []byte) string {
	for _, s := range [...]string{"POST", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"} {
		if string(m) == s {
			return s
		}
	}
	return string(m)
}

// arrival is when the request began to reach tokentap: the kernel's receive
// time of its first bytes, so that time spent in the socket before tokentap
// read it counts in every figure, as the client lived it.
func (p *Proxy) arrival(ctx *fasthttp.RequestCtx) time.Time {
	now := p.now()
	if c, ok := ctx.Conn().(*clientConn); ok {
		return c.arrival(now, p.opts.RequestReadTimeout)
	}
	return now
}

// roundTrip sends the request on a pooled or new connection.
//
// A request is sent again, on a new connection, only when the backend
// provably never received it: the connection was reused, no response byte
// came, the failure is a close or reset (not a timeout), and the backend's
// kernel acknowledged none of the request's bytes (TCP_INFO
// tcpi_bytes_acked unchanged since before the write). A socket the backend
// had already closed answers data with a reset and acknowledges nothing;
// one whose backend read the request has acknowledged it, and sending it
// again would run (and bill) the generation twice.
func (x *exchange) roundTrip(head bool) error {
	up := x.route.up
	for attempt := 0; ; attempt++ {
		c, err := up.get(context.Background(), attempt > 0)
		if err != nil {
			return err
		}
		if !x.cancel.attach(c.Conn) {
			up.discard(c)
			return errCancelled
		}
		acked := int64(-1)
		if c.reused {
			acked = c.bytesAcked()
		}
		written, err := c.send(x.req, x.resp, head)
		x.m.written = written
		if err == nil {
			x.conn = c
			// The response can reach the socket before the write is stamped.
			x.rec.UpstreamTTFB = max(c.first.Sub(written), 0)
			return nil
		}
		unread := c.reused && acked >= 0 && c.first.IsZero() && !isTimeout(err) && isConnReset(err) &&
			c.bytesAcked() == acked
		up.discard(c)
		x.cancel.detach()
		if x.cancel.isGone() {
			return errCancelled
		}
		if !unread || attempt > 0 {
			return err
		}
		metrics.UpstreamRetry()
	}
}

var errCancelled = errors.New("client closed the connection")

// isTimeout reports a deadline error, including fasthttp's ErrTimeout,
// which is not a full net.Error.
func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout() || errors.Is(err, os.ErrDeadlineExceeded)
}

// failEarly answers a request refused before its body was read: the
// connection is closed rather than drained of a body nobody needs.
func (p *Proxy) failEarly(ctx *fasthttp.RequestCtx, x *exchange, status int, code, msg string) {
	ctx.SetConnectionClose()
	outcome := metrics.OutcomeBadRequest
	if x.rec.Outcome != metrics.OutcomeOK {
		outcome = x.rec.Outcome
	}
	p.fail(ctx, x, status, outcome, code, msg)
}

// fail answers the client with a short JSON error and finishes the record.
// msg is in tokentap's words: never a header value, an upstream's bytes
// or an address.
func (p *Proxy) fail(ctx *fasthttp.RequestCtx, x *exchange, status int, outcome metrics.Outcome, code, msg string) {
	x.rec.Status = status
	x.rec.Outcome = outcome
	x.rec.Error = msg
	if status == 499 {
		// Nobody is listening: close without writing.
		ctx.SetConnectionClose()
		ctx.Response.SetStatusCode(status)
	} else {
		writeJSONError(ctx, status, code, msg, x.id)
	}
	x.finish(nil)
}

// serveError answers requests fasthttp could not parse (or whose body was
// too large) and records them like any other. fasthttp's error text quotes
// the request, credentials included: only its kind reaches the client and
// the log.
func (p *Proxy) serveError(ctx *fasthttp.RequestCtx, err error) {
	snap := p.snap.Load()
	x := p.acquireExchange(snap, p.arrival(ctx))
	x.rec.Series, x.rec.Route = snap.metrics.Unmatched(), metrics.UnmatchedRoute
	x.id = p.newRequestID(x.id[:0])
	x.rec.RequestID = string(x.id)
	x.rec.Method = methodString(ctx.Method())
	status, code, msg := fasthttp.StatusBadRequest, "bad_request", "the request cannot be parsed"
	var small *fasthttp.ErrSmallBuffer
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		status, code, msg = fasthttp.StatusRequestEntityTooLarge, "body_too_large", "the request body is too large"
	case errors.As(err, &small) || errors.Is(err, fasthttp.ErrSmallReadBuffer):
		status, code, msg = fasthttp.StatusRequestHeaderFieldsTooLarge, "headers_too_large", "the request headers are too large"
	case isTimeout(err):
		status, code, msg = fasthttp.StatusRequestTimeout, "request_timeout", "the request was not received in time"
	}
	ctx.SetConnectionClose()
	p.fail(ctx, x, status, metrics.OutcomeBadRequest, code, msg)
}

func writeJSONError(ctx *fasthttp.RequestCtx, status int, code, msg string, id []byte) {
	ctx.Response.Reset()
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.Response.Header.SetBytesV("X-Request-Id", id)
	b := []byte(`{"error":{"type":"tokentap_error","code":`)
	b = appendJSONString(b, code)
	b = append(b, `,"message":`...)
	b = appendJSONString(b, msg)
	b = append(b, "}}\n"...)
	ctx.SetBody(b)
}

func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, `\u00`...)
			b = append(b, "0123456789abcdef"[c>>4], "0123456789abcdef"[c&15])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// isConnReset reports errors that mean the peer closed the connection.
func isConnReset(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed)
}
