package proxy

import (
	"encoding/hex"
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// The exchange's attempts against its route's upstreams: the upstream
// request built and sent (upstream.Backend.RoundTrip), and the next
// upstream tried on a failure the route fails over on.

// forward is the loop of attempts: one against the chosen upstream, up to
// its response headers, then one against the route's next upstream for
// as long as failoverReason names a failure the route fails over on and
// the client is still there (failover: never after a byte reached the
// client). Within an attempt, roundTrip sends the request again on a new
// connection only by mayResend's rule. The last attempt's result is the
// request's.
func (x *exchange) forward(ctx *fasthttp.RequestCtx) *refusal {
	a := &x.att
	a.attemptAt = x.p.now()
	x.rec.Attempts = 1
	if fo := x.rt.Failover; fo != nil && fo.FirstTokenTimeout > 0 && fo.on(FailoverFirstToken) {
		a.firstByteLimit = fo.FirstTokenTimeout
	}
	for {
		err := x.attempt(ctx)
		reason := x.failoverReason(ctx, err)
		if reason == "" || x.cancel.IsGone() || !x.failover(reason) {
			return x.forwardResult(err)
		}
	}
}

// roundTrip sends the request on a pooled or new connection of the
// upstream, once more where the backend provably never received it
// (upstream.Backend.RoundTrip), up to the response headers.
func (x *exchange) roundTrip(head bool) error {
	a := &x.att
	t, err := a.up.RoundTrip(&x.cancel, a.req, a.resp, head, a.firstByteLimit)
	a.connectFailed = t.ConnectFailed
	if !t.Written.IsZero() {
		x.tap.Sent(t.Written)
	}
	if err == nil {
		a.conn = t.Conn // nil for an h2c backend
		// The response can reach the socket before the write is stamped.
		x.rec.UpstreamTTFB = max(t.FirstByte.Sub(t.Written), 0)
	}
	return err
}

// attempt builds the upstream request for the chosen upstream and sends
// it, up to the response headers.
func (x *exchange) attempt(ctx *fasthttp.RequestCtx) error {
	a := &x.att
	r, body := x.rt, x.in.body0
	// Prepare drops inbound X-Tokentap-* headers, the tenant's too.
	x.in.scratch = a.up.Prepare(ctx, a.req, r.strip(), r.stripKey, x.in.path, x.in.query, body, x.id, x.in.scratch)
	if x.tenant != "" {
		a.req.Header.Set(admission.TenantHeader, x.tenant)
	}
	if tc := &x.rec.Trace; tc.Valid() {
		// The upstream's work is a child of tokentap's span.
		x.in.traceparent = appendTraceparent(x.in.traceparent[:0], tc)
		a.req.Header.SetBytesV("traceparent", x.in.traceparent)
	}
	if r.InjectUsage && x.dialect == dialect.OpenAI && x.in.stream {
		if b, ok := dialect.InjectIncludeUsage(x.in.injected[:0], body); ok {
			// The one case where tokentap changes bytes: the upstream is
			// asked for usage, and the usage chunk it adds is removed from
			// the stream. Compression is declined so the chunk can be found.
			x.in.injected = b
			a.req.SetBodyRaw(b)
			a.req.Header.Del("Accept-Encoding")
			x.tap.Strip(true)
		}
	}
	return x.roundTrip(ctx.IsHead())
}

// forwardResult turns the last attempt's error into the request's
// refusal, or nil.
func (x *exchange) forwardResult(err error) *refusal {
	switch {
	case err == nil:
		return nil
	case x.cancel.IsGone():
		return refuseGone
	case sock.IsTimeout(err):
		return &refusal{status: fasthttp.StatusGatewayTimeout, outcome: metrics.OutcomeUpstreamTimeout, code: "upstream_timeout", msg: describeUpstreamError(err)}
	default:
		return &refusal{status: fasthttp.StatusBadGateway, outcome: metrics.OutcomeUpstreamError, code: "upstream_unavailable", msg: describeUpstreamError(err)}
	}
}

// failoverReason says why the attempt that ended with err should fail
// over, or "". On success it may wait for the first body byte
// (first_token_timeout).
func (x *exchange) failoverReason(ctx *fasthttp.RequestCtx, err error) string {
	a := &x.att
	fo := x.rt.Failover
	if fo == nil || len(x.rt.set.Members()) < 2 {
		return ""
	}
	switch {
	case err != nil && a.connectFailed:
		if fo.on(FailoverConnect) {
			return FailoverConnect
		}
	case err != nil && sock.IsTimeout(err) && a.conn == nil && fo.on(FailoverFirstToken) && fo.FirstTokenTimeout > 0:
		return FailoverFirstToken // no response header within the timeout
	case err == nil && a.resp.StatusCode() >= 500:
		if fo.on(FailoverStatus5xx) {
			return FailoverStatus5xx
		}
	case err == nil && fo.on(FailoverFirstToken) && fo.FirstTokenTimeout > 0 && !x.firstByteWithin(ctx, fo.FirstTokenTimeout):
		return FailoverFirstToken
	}
	return ""
}

// firstByteWithin waits until the response body's first byte is in, at
// most until timeout after the request was written. A response without a
// body passes at once.
func (x *exchange) firstByteWithin(ctx *fasthttp.RequestCtx, timeout time.Duration) bool {
	a := &x.att
	c, resp := a.conn, a.resp
	if c == nil {
		return true // an h2c backend: its header alone is waited for
	}
	if ctx.IsHead() || resp.StatusCode() < 200 || resp.StatusCode() == 204 || resp.StatusCode() == 304 ||
		resp.Header.ContentLength() == 0 || c.Buffered() > 0 {
		return true
	}
	left := timeout - x.p.now().Sub(x.tap.Written())
	if left <= 0 {
		return false
	}
	return c.ByteWithin(left)
}

// failover moves the request to the route's next upstream not tried yet
// (in the route's order, among those taking requests). It reports false
// when there is none.
func (x *exchange) failover(reason string) bool {
	a := &x.att
	next := x.nextMember()
	if next == nil {
		return false
	}
	now := x.p.now()
	metrics.FailedOver(x.rt.Name, a.mem.Name, reason)
	if a.conn != nil {
		a.up.Discard(a.conn) // closing it cancels the backend's work
		a.conn = nil
	}
	_ = a.resp.CloseBodyStream() // an h2c backend's stream: reset, its work cancelled
	x.cancel.Detach()
	a.req.Reset()
	a.resp.Reset()
	x.tap.Lost(now.Sub(a.attemptAt))
	if x.rec.Trace.Sampled {
		x.rec.Tries = append(x.rec.Tries, metrics.Try{Upstream: a.mem.Name, Addr: a.up.Addr(), Start: a.attemptAt,
			Duration: now.Sub(a.attemptAt), Reason: reason})
	}
	a.attemptAt = now
	a.tried = append(a.tried, a.mem)
	a.uncount()
	a.learned, a.ended = false, false
	a.mem = next
	a.count(now)
	a.up = next.Up
	x.rec.Upstream = next.Name
	x.rec.Series = x.snap.metrics.Series(next.Row, x.modelIdx)
	x.rec.Attempts++
	a.connectFailed = false
	x.tap.Strip(false)
	return true
}

// nextMember returns the upstream after the current one in the route's
// order that was not tried and takes requests, or nil.
func (x *exchange) nextMember() *routing.Member {
	a := &x.att
	ms := x.rt.set.Members()
	at := slices.Index(ms, a.mem)
	for i := 1; i < len(ms); i++ {
		m := ms[(at+i)%len(ms)]
		if x.rt.set.Weight(m) > 0 && !slices.Contains(a.tried, m) {
			return m
		}
	}
	return nil
}

// appendTraceparent appends tc as a W3C traceparent value: version 00, the
// trace, tokentap's span as the parent of the upstream's work, and the
// sampled flag.
func appendTraceparent(dst []byte, tc *metrics.TraceContext) []byte {
	dst = append(dst, "00-"...)
	dst = hex.AppendEncode(dst, tc.TraceID[:])
	dst = append(dst, '-')
	dst = hex.AppendEncode(dst, tc.SpanID[:])
	if tc.Sampled {
		return append(dst, "-01"...)
	}
	return append(dst, "-00"...)
}
