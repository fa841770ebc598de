package admission

import (
	"bytes"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission/shed"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/valyala/fasthttp"
)

// Overload is a route's overload control (admission/shed). With Shed, a
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
	// requests may claim: the header may lower it, never raise it. Without
	// tenants to cap it the header claims at most standard, unless
	// TrustPriorityHeader (every client, or a gateway in front that sets
	// it, may be believed).
	PriorityHeader      string
	TrustPriorityHeader bool
	// SLOHeaders lets a request set its own objectives for the decision
	// (X-SLO-TTFT-Ms, X-SLO-TPOT-Ms), over the route's and its tenant's.
	SLOHeaders bool
}

// Priority is a request's place under overload (admission/shed).
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

// Validate checks o, a route's overload control, given the objectives it
// could judge by: slos, the route's (over the default) and its tenants'.
// Its errors name the field under field.
func (o *Overload) Validate(field func(string) string, slos ...metrics.SLO) error {
	if o == nil || !o.Shed {
		return nil
	}
	judged := o.SLOHeaders
	for _, t := range slos {
		judged = judged || t.TTFT > 0 || t.TPOT > 0 || t.E2E > 0
	}
	if !judged {
		return conf.Errf(field("overload.shed"), "sheds by the TTFT and TPOT objectives (streams) and the E2E objective (whole responses), and the route has none: set slo.ttft, slo.tpot or slo.e2e (on the route, the default or its tenants), or overload.slo_headers")
	}
	if o.PriorityHeader != "" && !conf.IsToken(o.PriorityHeader) {
		return conf.Errf(field("overload.priority_header"), "%q is not a header name", o.PriorityHeader)
	}
	return nil
}

// PriorityOf is a request's priority under o: its header's (when the
// route has one), no higher than most, its tenant's (standard for a
// tenant that sets none); without tenants (tenants false), no higher than
// standard unless the route trusts the header (TrustPriorityHeader): any
// client could claim critical and starve the others.
func (o *Overload) PriorityOf(h *fasthttp.RequestHeader, tenants bool, most Priority) Priority {
	if !tenants {
		most = PriorityStandard
		if o.TrustPriorityHeader {
			most = PriorityCritical
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

// Objectives is slo with a request's own objectives over it, where the
// route takes them from its headers (SLOHeaders).
func (o *Overload) Objectives(h *fasthttp.RequestHeader, slo metrics.SLO) metrics.SLO {
	if !o.SLOHeaders {
		return slo
	}
	return slo.Over(metrics.SLO{TTFT: headerMS(h.PeekBytes(headerSLOTTFT)), TPOT: headerMS(h.PeekBytes(headerSLOTPOT))})
}

// Request is what the overload step knows of a request as it judges it:
// the upstream's gate, its requests held there as this one is sent (k),
// the request's input tokens (in, -1: unknown), priority and objectives,
// whether it is judged as a whole response (once its body says it is no
// stream) and its route's first-byte timeout.
type Request struct {
	Gate      *shed.Gate
	K, In     int
	Priority  Priority
	SLO       metrics.SLO
	Whole     bool
	FirstByte time.Duration
}

// Judge is the prediction for r at now and, where its objectives can be
// judged, whether it would miss them (Verdict.Shed): a stream by its TTFT
// and TPOT objectives, a whole response by its time to the whole response
// against its E2E objective (shed.Gate.JudgeWhole). judged is false for a
// whole response without an E2E objective.
func Judge(now time.Time, r Request) (v shed.Verdict, judged bool) {
	if r.Whole {
		if r.SLO.E2E <= 0 {
			return v, false
		}
		return r.Gate.JudgeWhole(now, r.K, r.In, r.Priority, r.SLO.E2E, r.FirstByte), true
	}
	return r.Gate.Judge(now, r.K, r.In, r.Priority, shed.Objectives{TTFT: r.SLO.TTFT, TPOT: r.SLO.TPOT}, r.FirstByte), true
}

// headerMS reads a whole number of milliseconds (0: absent or not one).
func headerMS(v []byte) time.Duration {
	n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
	if err != nil || n <= 0 || n > 3_600_000 {
		return 0
	}
	return time.Duration(n) * time.Millisecond
}
