package proxy

import (
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// upstreamAttempt is the request's attempts against its route's
// upstreams: the one chosen now, the connection and the upstream request
// and response of the current attempt, and those tried before (failover).
// Owner: the serving goroutine (a shadow copy's: its own goroutine).
type upstreamAttempt struct {
	x              *exchange         // the exchange it is the attempts of
	mem            *routing.Member   // the upstream chosen, once routed
	up             *upstream.Backend // mem.Up
	conn           *upstream.Conn
	req            *fasthttp.Request
	resp           *fasthttp.Response
	connectFailed  bool              // the last attempt could not connect
	tried          []*routing.Member // upstreams tried before the current one
	attemptAt      time.Time         // when the current attempt began
	firstByteLimit time.Duration     // bounds the wait for the response header (failover)
	startK         int               // tokentap's requests in flight at the upstream when this one was sent to it
	counted        bool              // counted in the upstream's requests in flight (count)
	learned, ended bool              // its model learned its first token, its end (learnFirst, learnEnd)
}

// count counts the request in its upstream's requests in flight, from
// when it is picked until it ends, but for its wait in its tenant's
// admission queue (exchange.admit): startK is the level it starts at,
// tokentap's own requests there. The model files what the request lives
// at that level: a scrape (held) moves where a prediction is read, never
// where a measurement is filed, so a scrape that claims what is not so
// corrupts nothing the model keeps.
func (a *upstreamAttempt) count(now time.Time) {
	if a.counted || a.mem == nil {
		return
	}
	a.counted = true
	a.startK = int(a.mem.Up.Inflight.Add(1) - 1)
}

// uncount takes the request out of its upstream's requests in flight.
func (a *upstreamAttempt) uncount() {
	if a.counted {
		a.counted = false
		a.mem.Up.Inflight.Add(-1)
	}
}

// kept is the part's next life in a pooled exchange: the request and
// response objects, reset (a request let go of is taken again), and the
// list's room.
func (a *upstreamAttempt) kept() upstreamAttempt {
	if a.req == nil {
		a.req = fasthttp.AcquireRequest()
	} else {
		a.req.Reset()
	}
	a.resp.Reset()
	return upstreamAttempt{x: a.x, req: a.req, resp: a.resp, tried: a.tried[:0]}
}

// letRequestGo gives the request sent upstream back to fasthttp's pool
// once no attempt can send it again (a stream under way): an open stream
// then holds neither it nor its header's buffers (some 1.6 KB, a third of
// an idle stream's exchange), which the streams still starting take.
func (a *upstreamAttempt) letRequestGo() {
	fasthttp.ReleaseRequest(a.req)
	a.req = nil
}

// forward is the loop of attempts: one against the chosen upstream, up to
// its response headers, then one against the route's next upstream for
// as long as failoverReason names a failure the route fails over on and
// the client is still there (failover: never after a byte reached the
// client). Within an attempt, roundTrip sends the request again on a new
// connection only by mayResend's rule. The last attempt's result is the
// request's.
func (a *upstreamAttempt) forward(ctx *fasthttp.RequestCtx) *refusal {
	a.x.rt.shadow.start(a.x, ctx)
	a.attemptAt = a.x.p.now()
	a.x.rec.Attempts = 1
	if fo := a.x.rt.Failover; fo != nil && fo.FirstTokenTimeout > 0 && fo.on(FailoverFirstToken) {
		a.firstByteLimit = fo.FirstTokenTimeout
	}
	for {
		err := a.attempt(ctx)
		reason := a.failoverReason(ctx, err)
		if reason == "" || a.x.cancel.IsGone() || !a.failover(reason) {
			return a.forwardResult(err)
		}
	}
}

// roundTrip sends the request on a pooled or new connection of the
// upstream, once more where the backend provably never received it
// (upstream.Backend.RoundTrip), up to the response headers.
func (a *upstreamAttempt) roundTrip(head bool) error {
	t, err := a.up.RoundTrip(&a.x.cancel, a.req, a.resp, head, a.firstByteLimit)
	a.connectFailed = t.ConnectFailed
	if !t.Written.IsZero() {
		a.x.tap.Sent(t.Written)
	}
	if err == nil {
		a.conn = t.Conn
		// The response can reach the socket before the write is stamped.
		a.x.rec.UpstreamTTFB = max(t.Conn.FirstByte().Sub(t.Written), 0)
	}
	return err
}

// attempt builds the upstream request for the chosen upstream and sends
// it, up to the response headers.
func (a *upstreamAttempt) attempt(ctx *fasthttp.RequestCtx) error {
	r, body := a.x.rt, a.x.in.body0
	// Prepare drops inbound X-Tokentap-* headers, the tenant's too.
	a.x.in.scratch = a.up.Prepare(ctx, a.req, r.strip(), r.stripKey, a.x.in.path, a.x.in.query, body, a.x.id, a.x.in.scratch)
	if a.x.tenant != "" {
		a.req.Header.Set(admission.TenantHeader, a.x.tenant)
	}
	if tc := &a.x.rec.Trace; tc.Valid() {
		// The upstream's work is a child of tokentap's span.
		a.x.in.traceparent = appendTraceparent(a.x.in.traceparent[:0], tc)
		a.req.Header.SetBytesV("traceparent", a.x.in.traceparent)
	}
	if r.InjectUsage && a.x.dialect == dialect.OpenAI && a.x.in.stream {
		if b, ok := dialect.InjectIncludeUsage(a.x.in.injected[:0], body); ok {
			// The one case where tokentap changes bytes: the upstream is
			// asked for usage, and the usage chunk it adds is removed from
			// the stream. Compression is declined so the chunk can be found.
			a.x.in.injected = b
			a.req.SetBodyRaw(b)
			a.req.Header.Del("Accept-Encoding")
			a.x.tap.Strip(true)
		}
	}
	return a.roundTrip(ctx.IsHead())
}

// forwardResult turns the last attempt's error into the request's
// refusal, or nil.
func (a *upstreamAttempt) forwardResult(err error) *refusal {
	switch {
	case err == nil:
		return nil
	case a.x.cancel.IsGone():
		return refuseGone
	case sock.IsTimeout(err):
		return &refusal{status: fasthttp.StatusGatewayTimeout, outcome: metrics.OutcomeUpstreamTimeout, code: "upstream_timeout", msg: describeUpstreamError(err)}
	default:
		return &refusal{status: fasthttp.StatusBadGateway, outcome: metrics.OutcomeUpstreamError, code: "upstream_unavailable", msg: describeUpstreamError(err)}
	}
}
