package proxy

import (
	"math/rand/v2"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/valyala/fasthttp"
)

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
	s := acquireExchange(x.p, x.snap, x.p.now())
	// The copy holds a copy of the body for as long as it runs: it counts
	// in the budget of all requests' bodies (released when it finishes),
	// and is not sent when the budget is spent.
	if !s.in.holdBody(x.p, int64(len(x.in.body0))) {
		sh.inflight.Add(-1)
		releaseExchange(s)
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
	if err := x.roundTrip(false); err != nil {
		r := x.forwardResult(err)
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
