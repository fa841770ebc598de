package proxy

import (
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/valyala/fasthttp"
)

// Shadow sends a copy of a sampled share of a route's requests to another
// of its upstreams, reads and measures the copy's response fully, and
// discards it. The client's request never waits for its shadow: the copy
// is sent from a goroutine of its own once the request is admitted.
type Shadow struct {
	// Upstream names one of the route's upstreams (usually of weight 0).
	Upstream string
	// Sample is the share of requests copied (0 … 1).
	Sample float64
	// MaxInflight bounds the copies in flight; beyond it a copy is
	// skipped and counted (tokentap_shadow_skipped_total).
	MaxInflight int
	// Timeout bounds a copy's whole life, from its send to its response's
	// end (default DefaultShadowTimeout): a stalled shadow upstream holds
	// its copy of the body against max_buffered_bodies, and a place among
	// MaxInflight, no longer, where the route's first-byte timeout (10
	// minutes) would hold them.
	Timeout time.Duration
}

// DefaultShadowTimeout is a shadow copy's life when Shadow.Timeout is 0.
const DefaultShadowTimeout = time.Minute

// withDefaults returns s with its zero fields set to their defaults.
func (s Shadow) withDefaults() Shadow {
	if s.MaxInflight == 0 {
		s.MaxInflight = 16
	}
	if s.Timeout == 0 {
		s.Timeout = DefaultShadowTimeout
	}
	return s
}

// shadowState is a route's shadow at run time.
type shadowState struct {
	Shadow
	member   *routing.Member
	inflight atomic.Int64
}

// start copies x's request to the route's shadow upstream sh (nil: none),
// when it is sampled and a place is free. Everything the copy needs is
// taken from ctx now; the rest runs on its own goroutine.
func (sh *shadowState) start(x *exchange, ctx *fasthttp.RequestCtx) {
	if sh == nil || rand.Float64() >= sh.Sample {
		return
	}
	if sh.inflight.Add(1) > int64(sh.MaxInflight) {
		sh.inflight.Add(-1)
		metrics.ShadowSkipped(x.rt.Name, "max_inflight")
		return
	}
	s := x.p.acquireExchange(x.snap, x.p.now())
	// The copy holds a copy of the body for as long as it runs: it counts
	// in the budget of all requests' bodies (released when it finishes),
	// and is not sent when the budget is spent.
	if !s.in.holdBody(x.p, int64(len(x.in.body0))) {
		sh.inflight.Add(-1)
		x.p.releaseExchange(s)
		metrics.ShadowSkipped(x.rt.Name, "body_budget")
		return
	}
	s.shadow = true
	s.rt, s.att.mem, s.att.up, s.dialect, s.in.stream = x.rt, sh.member, sh.member.Up, x.dialect, x.in.stream
	s.att.count(x.p.now())
	s.id = append(append(s.id[:0], x.id...), "-shadow"...)
	rec, src := &s.rec, &x.rec
	rec.RequestID, rec.Route, rec.Upstream, rec.Shadow = string(s.id), src.Route, sh.member.Name, true
	rec.Model, rec.Tenant, rec.Method, rec.Path, rec.Dialect, rec.Stream = src.Model, src.Tenant, src.Method, src.Path, src.Dialect, src.Stream
	rec.BytesIn = src.BytesIn
	rec.Series = x.snap.metrics.Series(sh.member.Row, x.modelIdx)
	// The copy goes without the usage injection: it is measured as it
	// comes, its tokens counted.
	s.in.scratch = s.att.up.Prepare(ctx, s.att.req, x.rt.strip(), x.rt.stripKey, x.in.path, x.in.query, nil, s.id, s.in.scratch)
	s.att.req.SetBody(x.in.body0)
	if x.tenant != "" {
		s.att.req.Header.Set(admission.TenantHeader, x.tenant)
	}
	go sh.run(s)
}

// run sends the copy x and reads its response to the end, measuring it as
// if a client read each chunk the moment it came, then records it.
func (sh *shadowState) run(x *exchange) {
	defer sh.inflight.Add(-1)
	x.att.attemptAt = x.p.now()
	x.rec.Attempts = 1
	// At its timeout the copy is cut as a client that left cuts its
	// request (its connection closed); the cut is over before the copy
	// finishes, so nothing reaches an exchange given back.
	expired := make(chan struct{})
	cut := time.AfterFunc(sh.Timeout, func() { x.fire(); close(expired) })
	stop := func() {
		if !cut.Stop() {
			<-expired
			x.rec.Outcome, x.rec.Error = metrics.OutcomeUpstreamTimeout, "shadow copy cut at its timeout (shadow.timeout)"
		}
	}
	x.att.firstByteLimit = sh.Timeout
	if err := x.att.roundTrip(false); err != nil {
		r := x.att.forwardResult(err)
		x.rec.Status, x.rec.Outcome, x.rec.Error = r.status, r.outcome, r.msg
		stop()
		x.Finish(nil)
		return
	}
	x.responded = true
	x.rec.Status = x.att.resp.StatusCode()
	body := x.att.resp.BodyStream()
	if body == nil {
		x.relay.NoBody(0)
		stop()
		x.Finish(nil)
		return
	}
	x.relay.Start(body, x.att.conn, nil, x.att.resp.Header.ContentLength())
	x.startParsing(x.att.resp)
	x.relay.Drain()
	stop()
	x.Finish(nil)
}
