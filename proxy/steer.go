package proxy

import (
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/valyala/fasthttp"
)

// The exchange's steps that decide where a request goes and whether it
// goes: its route settled by the model it names, its upstream chosen
// (routing.Set.Choose), its priority and overload's verdict
// (proxy/admission), its tenant's admission and what it is charged, and
// what the upstream's model learns from it once it ends.

// modelNotFound is the refusal of a request whose model no route serves,
// in the dialect's words: a 404 as the provider gives for a model it does
// not have, naming it as the record keeps it (at most 128 bytes, escaped
// in the JSON body).
func (x *exchange) modelNotFound() *refusal {
	r := &refusal{status: fasthttp.StatusNotFound, outcome: metrics.OutcomeBadRequest, code: "model_not_found",
		errType: "invalid_request_error", msg: "the model " + strconv.Quote(x.rec.Model) + " is not served here"}
	if x.dialect != nil && x.dialect.Name() == "anthropic" {
		r.errType, r.anthropic = "not_found_error", true
	}
	return r
}

// duplicateMember is the refusal of a body that gives name ("model" or
// "stream") twice: tokentap reads the first, a backend that decodes with
// Go or pydantic the last, so the request would be routed, priced and
// checked as one model and served as another. A 400 in the dialect's
// words.
func (x *exchange) duplicateMember(name string) *refusal {
	r := &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "duplicate_member",
		errType: "invalid_request_error", msg: "the request body gives \"" + name + "\" more than once"}
	if x.dialect != nil && x.dialect.Name() == "anthropic" {
		r.anthropic = true
	}
	return r
}

// pickLate settles the route of a request that waited for its body
// (route.late): by the model it names where routes name models; then
// chooses its upstream.
func (x *exchange) pickLate(model string, h *fasthttp.RequestHeader) *refusal {
	snap, rec := x.snap, &x.rec
	r := x.rt
	if len(r.Models) > 0 {
		r = snap.matchModel(x.in.path, model)
	}
	if r == nil {
		x.rt = nil
		rec.Route, rec.Series = metrics.UnmatchedRoute, snap.metrics.Unmatched()
		return x.modelNotFound()
	}
	x.rt, rec.Route = r, r.Name
	if r.dialect != nil {
		x.dialect = r.dialect
		rec.Dialect = x.dialect.Name()
	}
	x.pickUpstream(r, h)
	return nil
}

// pickUpstream chooses the request's upstream on route r and counts it in
// flight there.
func (x *exchange) pickUpstream(r *route, h *fasthttp.RequestHeader) {
	rec, snap := &x.rec, x.snap
	c := r.set.Choose(&routing.Request{Now: x.p.now(), Body: x.in.body0, Tenant: x.tenant, Header: h, Objective: x.slo().TTFT})
	if c.TTFT >= 0 {
		rec.Predicted.TTFT = c.TTFT
	}
	x.in.stickyKey, x.in.stickyKeyed = c.Key, c.Keyed
	x.att.mem = c.Member
	// The level the request starts at: tokentap's requests there, and
	// what the backend says it holds beyond them (scrape.go).
	x.att.count(x.p.now())
	x.att.up, rec.Upstream = x.att.mem.Up, x.att.mem.Name
	rec.Series = snap.metrics.Series(x.att.mem.Row, snap.metrics.OtherIndex())
}

// slo is the request's objectives: its route's, under its tenant's.
func (x *exchange) slo() metrics.SLO {
	slo := x.rt.slo
	if t, ok := x.snap.cfg.TenantSLOs[x.tenant]; ok {
		slo = slo.Over(t)
	}
	return slo
}

// pace is what the request's stream is read against: its route's qoe
// times, else its objectives (under its tenant's), else the defaults.
func (x *exchange) pace() measure.Pace {
	slo := x.slo()
	return measure.Pace{TTFT: slo.TTFT, Read: slo.TPOT}.Over(x.rt.QoE)
}

// overload is the request's overload step: the prediction for its
// upstream now and, with Shed, the refusal of a request that would miss
// its objectives. Before its body is read a request is judged as a
// stream, by its TTFT and TPOT objectives; once its body says it is not
// one (whole), by its time to the whole response against its E2E
// objective (shed.Gate.JudgeWhole).
func (x *exchange) overload(ctx *fasthttp.RequestCtx, whole bool) *refusal {
	o := x.rt.Overload
	if o == nil {
		return nil
	}
	h := &ctx.Request.Header
	most, ok := x.snap.cfg.TenantPriorities[x.tenant]
	if !ok {
		most = PriorityStandard
	}
	prio := o.PriorityOf(h, x.snap.admit != nil, most)
	x.rec.Priority = prio.String()
	k := x.att.mem.Held(x.p.now(), x.att.startK) // the backend's own count included, where it says
	in := len(x.in.body0) / 4
	if cl := h.ContentLength(); !whole && cl > 0 {
		in = cl / 4 // what admission control estimates too, before the body
	} else if !whole && !x.in.late {
		in = -1
	}
	v, judged := admission.Judge(x.p.now(), admission.Request{Gate: x.att.up.Gate, K: k, In: in, Priority: prio,
		SLO: o.Objectives(h, x.slo()), Whole: whole, FirstByte: x.rt.Timeouts.FirstByte})
	if !judged {
		return nil
	}
	if v.Known {
		x.rec.Predicted.TTFT, x.rec.Predicted.TPOT = v.TTFT, v.TPOT
	}
	if !o.Shed || !v.Shed {
		return nil
	}
	metrics.Shed(x.rt.Name, x.att.mem.Name, prio.String())
	x.att.up.Gate.Refused(x.p.now())
	what := "TTFT"
	if whole {
		what = "response time"
	}
	r := &refusal{status: fasthttp.StatusServiceUnavailable, outcome: metrics.OutcomeShed, code: "overloaded", errType: "overloaded",
		msg:  "the upstream is overloaded: this request would miss its objectives, retry later",
		note: "shed: predicted " + what + " " + strconv.FormatFloat(float64(v.TTFT)/1e6, 'f', 1, 64) + " ms at " + strconv.Itoa(k) + " in flight",
		// A body not read yet is not read: the connection closes after the answer.
		close: !x.in.late && !whole, retryAfter: v.RetryAfter}
	if !v.Known {
		r.note = "shed: " + strconv.Itoa(k) + " in flight, past the levels measured while critical requests come"
	}
	if x.dialect != nil && x.dialect.Name() == "anthropic" {
		// Anthropic's own answer to an overloaded API.
		r.status, r.errType, r.anthropic = 529, "overloaded_error", true
	}
	return r
}

// The upstream's model learns what its requests live there: a stream's
// first token as it comes (learnFirst), its time per output token at its
// end (learnEnd); a whole response's time at its end, in the model of
// whole responses. Each from when the request was sent (a wait in the
// admission queue, or for the client's upload, is not the backend's) to
// when the kernel received the upstream's bytes: time tokentap spent
// waiting for a processor on a busy machine is not the backend's either.

// learnFirst teaches the upstream's model a stream's first token.
func (x *exchange) learnFirst() {
	if x.rt == nil || !x.rt.predicts() || !x.att.counted || x.tap.Written().IsZero() || x.tap.FirstTokenRead().IsZero() {
		return
	}
	ttft := max(x.tap.FirstTokenRead().Sub(x.tap.Written()), 0)
	x.att.up.Gate.Model.ObserveFirst(x.att.startK, len(x.in.body0)/4, ttft, x.rec.Predicted.TTFT)
	x.att.learned = true
}

// learnEnd teaches the upstream's models a request's end: a stream's time
// per output token, a whole response's time (complete: it came whole).
func (x *exchange) learnEnd(complete bool) {
	if x.rt == nil || !x.rt.predicts() || x.att.up == nil || x.att.ended || x.rec.Attempts == 0 {
		return
	}
	x.att.ended = true
	g := x.att.up.Gate
	switch {
	case x.tap.Streamed() && x.att.learned:
		g.Model.ObserveEnd(x.att.startK, x.rec.TPOT)
	case !x.tap.Streamed() && x.rec.Method == "POST" && complete && !x.tap.FirstByteRead().IsZero() && !x.tap.Written().IsZero():
		whole := max(x.tap.FirstByteRead().Sub(x.tap.Written()), 0)
		g.Whole.Observe(x.att.startK, len(x.in.body0)/4, whole, -1, x.rec.Predicted.TTFT)
	default:
		g.Model.ObserveEnd(x.att.startK, -1) // a completion, nothing measured
	}
}

// admit runs admission control for the identified tenant, waiting in its
// queue when the mode says so.
func (x *exchange) admit() *refusal {
	a := x.snap.admit
	if a == nil {
		return nil
	}
	var total int64
	x.estIn, total = admission.Estimate(x.in.body0, x.dialect, x.snap.cfg.DefaultMaxOutput)
	usd := x.charge.Cost(int(x.estIn), 0, 0, int(total-x.estIn)) // what it may cost, for the dollar budgets
	start := x.p.now()
	// A request waiting in its tenant's queue is not at its upstream: it
	// is counted there again once admitted, at the level it starts at then.
	x.att.uncount()
	ticket, refused := a.AdmitUSD(x.cancel.Context(), x.tenant, x.rt.Name, total, usd)
	x.rec.Queue = x.p.now().Sub(start)
	if refused == nil {
		x.att.count(x.p.now())
		x.ticket = ticket
		return nil
	}
	x.rec.TenantSeries.Rejected(string(refused.Reason))
	if refused.Reason == ratelimit.ReasonCancelled {
		return refuseGoneWhileQueued
	}
	if refused.Reason == ratelimit.ReasonStore {
		return &refusal{status: fasthttp.StatusServiceUnavailable, outcome: metrics.OutcomeRejected, code: "admission_store_unavailable",
			msg: "admission control cannot reach its shared store, retry later", note: "rejected: admission store unavailable", retryAfter: time.Second}
	}
	return &refusal{status: fasthttp.StatusTooManyRequests, outcome: metrics.OutcomeLimited, code: "rate_limit_exceeded",
		msg:  "rate limit reached (" + string(refused.Reason) + "), retry later",
		note: "rate limited: " + string(refused.Reason), retryAfter: refused.RetryAfter, rateLimited: true}
}

// chargeFor is how a request of the route served as model is priced: at
// the model's price, else, for a tenant with a dollar budget, at the
// route's dearest.
func (x *exchange) chargeFor(model string) measure.Charge {
	if p := measure.PriceOf(x.snap.cfg.Prices, model); p != nil {
		return measure.Charge{Price: p}
	}
	if a := x.snap.admit; a != nil && x.rt != nil && a.SpendsDollars(x.tenant, x.rt.Name) {
		return measure.Charge{Dearest: &x.rt.prices}
	}
	return measure.Charge{}
}

// releaseTicket returns the request's admission ticket with the tokens it
// really used: the usage the backend reported, or the input estimate and
// the output tokens counted; nothing when no response came or the backend
// refused the request without usage.
func (x *exchange) releaseTicket() {
	if x.ticket == nil {
		return
	}
	var actual int64
	var usd float64
	if x.responded && (x.rec.Status < 400 || x.tap.UsageReported()) {
		actual, usd = x.tap.Used(x.rec.BytesIn, x.charge)
	}
	x.ticket.ReleaseUSD(actual, usd)
	x.ticket = nil
}
