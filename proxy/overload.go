package proxy

import (
	"bytes"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/shed"
	"github.com/valyala/fasthttp"
)

// Overload is a route's overload control (proxy/shed). With Shed, a
// request its upstream is predicted not to serve within its objectives
// (the route's, its tenant's, or with SLOHeaders its own) is refused at
// once, before its body is read: 529 overloaded_error on Anthropic routes,
// 503 on the others, with Retry-After when the queue is predicted to have
// drained. Lower priorities go first; a critical request is refused only
// when it would not get a first token before the route's first-byte
// timeout at all. A shed request counts against goodput: refusing is no
// way to meet an SLO.
type Overload struct {
	// Shed turns the refusals on (the predictions are made either way).
	Shed bool
	// PriorityHeader names the request header that says a request's
	// priority (critical, standard, sheddable; anything else: standard).
	// A tenant's priority (Config.TenantPriorities) is the most its
	// requests may claim: the header may lower it, never raise it.
	PriorityHeader string
	// SLOHeaders lets a request set its own objectives for the decision
	// (X-SLO-TTFT-Ms, X-SLO-TPOT-Ms), over the route's and its tenant's.
	SLOHeaders bool
}

// Priority is a request's place under overload (proxy/shed).
type Priority = shed.Priority

// The priorities, most important first.
const (
	PriorityCritical  = shed.Critical
	PriorityStandard  = shed.Standard
	PrioritySheddable = shed.Sheddable
)

// ParsePriority reads a priority's name.
func ParsePriority(s string) (Priority, bool) { return shed.ParsePriority(s) }

// The request headers of a request's own objectives (Overload.SLOHeaders).
var (
	headerSLOTTFT = []byte("X-SLO-TTFT-Ms")
	headerSLOTPOT = []byte("X-SLO-TPOT-Ms")
)

// validOverload checks route r's overload control against the objectives
// it could judge by.
func (c *Config) validOverload(r Route, field func(string) string) error {
	o := r.Overload
	if o == nil || !o.Shed {
		return nil
	}
	slo := c.SLO.Over(r.SLO)
	judged := slo.TTFT > 0 || slo.TPOT > 0 || o.SLOHeaders
	for _, t := range c.TenantSLOs {
		judged = judged || t.TTFT > 0 || t.TPOT > 0
	}
	if !judged {
		return fieldErr(field("overload.shed"), "sheds by the TTFT and TPOT objectives, and the route has none: set slo.ttft or slo.tpot (on the route, the default or its tenants), or overload.slo_headers")
	}
	if o.PriorityHeader != "" && !isToken(o.PriorityHeader) {
		return fieldErr(field("overload.priority_header"), "%q is not a header name", o.PriorityHeader)
	}
	return nil
}

// priority is the request's priority: its header's (when the route has
// one), no higher than its tenant's (standard for a tenant that sets
// none); without admission control the header alone says it.
func (x *exchange) priority(h *fasthttp.RequestHeader, o *Overload) Priority {
	most := PriorityCritical
	if x.snap.admit != nil {
		most = PriorityStandard
		if p, ok := x.snap.cfg.TenantPriorities[x.tenant]; ok {
			most = p
		}
	}
	p := PriorityStandard
	if o.PriorityHeader != "" {
		if v := h.Peek(o.PriorityHeader); len(v) > 0 {
			p, _ = ParsePriority(string(bytes.ToLower(bytes.TrimSpace(v))))
		}
	}
	return max(p, most) // higher numbers are lower priorities
}

// overload is the request's overload step, before its body is read: the
// prediction for its upstream now and, with Shed, the refusal of a request
// that would miss its objectives.
func (x *exchange) overload(ctx *fasthttp.RequestCtx) *refusal {
	o := x.rt.Overload
	if o == nil {
		return nil
	}
	h := &ctx.Request.Header
	prio := x.priority(h, o)
	x.rec.Priority = prio.String()
	in := -1
	if cl := h.ContentLength(); cl > 0 {
		in = cl / 4 // what admission control estimates too, before the body
	}
	slo := x.rt.slo
	if t, ok := x.snap.cfg.TenantSLOs[x.tenant]; ok {
		slo = slo.Over(t)
	}
	if o.SLOHeaders {
		slo = slo.Over(metrics.SLO{TTFT: headerMS(h.PeekBytes(headerSLOTTFT)), TPOT: headerMS(h.PeekBytes(headerSLOTPOT))})
	}
	v := x.att.up.gate.Judge(x.p.now(), x.att.startK, in, prio, shed.Objectives{TTFT: slo.TTFT, TPOT: slo.TPOT}, x.rt.Timeouts.FirstByte)
	if !v.Known {
		return nil // nothing measured lately: nothing to decide on
	}
	x.rec.PredictedTTFT, x.rec.PredictedTPOT = v.TTFT, v.TPOT
	if !o.Shed || !v.Shed {
		return nil
	}
	metrics.Shed(x.rt.Name, x.att.mem.name, prio.String())
	x.att.up.gate.Refused(x.p.now())
	r := &refusal{status: fasthttp.StatusServiceUnavailable, outcome: metrics.OutcomeShed, code: "overloaded", errType: "overloaded",
		msg:  "the upstream is overloaded: this request would miss its objectives, retry later",
		note: "shed: predicted TTFT " + strconv.FormatFloat(float64(v.TTFT)/1e6, 'f', 1, 64) + " ms at " + strconv.Itoa(x.att.startK) + " in flight",
		// The body is not read: the connection closes after the answer.
		close: true, retryAfter: v.RetryAfter}
	if x.dialect != nil && x.dialect.Name() == "anthropic" {
		// Anthropic's own answer to an overloaded API.
		r.status, r.errType, r.anthropic = 529, "overloaded_error", true
	}
	return r
}

// isToken reports a header name made of token characters.
func isToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !tchar[s[i]] {
			return false
		}
	}
	return s != ""
}

// headerMS reads a whole number of milliseconds (0: absent or not one).
func headerMS(v []byte) time.Duration {
	n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
	if err != nil || n <= 0 || n > 3_600_000 {
		return 0
	}
	return time.Duration(n) * time.Millisecond
}

// observeUpstream tells the upstream's model what the request lived there:
// its time to first token from when it was sent on (the admission queue
// is tokentap's, not the backend's) and its time per output token, with
// the prediction made for it.
func (x *exchange) observeUpstream() {
	if x.rt == nil || !x.rt.predicts() || x.att.up == nil || x.rec.Attempts == 0 || !x.rec.Stream {
		return // a whole response's first byte is its end: no first token to learn from
	}
	rec := &x.rec
	ttft := rec.TTFT
	if ttft >= 0 && rec.Queue > 0 {
		ttft -= rec.Queue
	}
	x.att.up.gate.Model.Observe(x.att.startK, x.tap.m.usage.input(rec.BytesIn), ttft, rec.TPOT, rec.PredictedTTFT)
}

// fillShares puts in o upstream m's share of route r's requests and what
// its backend said of its prompt cache, since the configuration.
func fillShares(o *stats.Overload, r *route, m *member) {
	var all int64
	for _, n := range r.members {
		all += n.picked()
	}
	if all > 0 {
		o.Share = float64(m.picked()) / float64(all)
	}
	for i := range m.why {
		if n := m.why[i].Load(); n > 0 {
			if o.Why == nil {
				o.Why = map[string]int64{}
			}
			o.Why[pickReasonNames[i]] = n
		}
	}
	if m.scrape != nil {
		o.Backend = &stats.BackendState{Running: -1, Waiting: -1, KVCache: -1, Error: "not scraped yet"}
		if st := m.scrape.state.Load(); st != nil {
			o.Backend = &stats.BackendState{Running: st.Running, Waiting: st.Waiting, KVCache: st.KV, Error: st.Err,
				AgeS: m.scrape.now().Sub(st.At).Seconds()}
		}
	}
	c := &m.cache
	o.CacheReported, o.TTFTHitMs, o.TTFTMissMs = c.reported.Load(), -1, -1
	if o.CacheReported > 0 {
		o.CacheHitShare = float64(c.hits.Load()) / float64(o.CacheReported)
	}
	if n := c.hitTTFTn.Load(); n > 0 {
		o.TTFTHitMs = float64(c.hitTTFTus.Load()) / float64(n) / 1000
	}
	if n := c.missTTFTn.Load(); n > 0 {
		o.TTFTMissMs = float64(c.missTTFTus.Load()) / float64(n) / 1000
	}
}
