package metrics

import (
	"strings"
	"time"
)

// SLO is a set of latency objectives for one request: each request that
// finished is good when it succeeded (outcome ok) and met every objective
// that applies to it. A zero duration means "no objective" for that measure.
// TTFT, TTFA and TPOT apply only where the request measured them (a
// non-streamed response has none); E2E applies to every request.
type SLO struct {
	TTFT, TTFA, TPOT, E2E time.Duration
	// Target is the share of requests that should be good (0.99 for 99%);
	// 0: none. Goodput under it raises a warning in /stats.
	Target float64
	// Measure says whose times TTFT, TTFA and E2E are judged on: "client"
	// (the default: the client's, network included, where the record has
	// them) or "proxy" (tokentap's own marks).
	Measure string
	// QoE is the least reading score a stream may have (Record.Reading.QoE,
	// 0 to 1); 0: none. It applies to streams with tokens only.
	QoE float64
}

// Measures of an SLO.
const (
	MeasureClient = "client"
	MeasureProxy  = "proxy"
)

// IsZero reports whether s sets no objective.
func (s SLO) IsZero() bool { s.Measure = ""; return s == SLO{} }

// Over returns s with every field that o sets taken from o: a route's SLO
// over the default, a tenant's over the route's.
func (s SLO) Over(o SLO) SLO {
	pick := func(dst *time.Duration, v time.Duration) {
		if v > 0 {
			*dst = v
		}
	}
	pick(&s.TTFT, o.TTFT)
	pick(&s.TTFA, o.TTFA)
	pick(&s.TPOT, o.TPOT)
	pick(&s.E2E, o.E2E)
	if o.Target > 0 {
		s.Target = o.Target
	}
	if o.Measure != "" {
		s.Measure = o.Measure
	}
	if o.QoE > 0 {
		s.QoE = o.QoE
	}
	return s
}

// SLOMisses is a set of missed objectives, one bit per SLOName.
type SLOMisses uint8

// The objectives a request can miss; SLOFailed is a request that did not
// succeed at all, SLOUnacked one whose client did not acknowledge all of
// its response (judged on the client's times only: what the client did
// not receive is not good, whatever tokentap's own clock says).
const (
	SLOTTFT SLOMisses = 1 << iota
	SLOTTFA
	SLOTPOT
	SLOE2E
	SLOFailed
	SLOUnacked
	SLOQoE
)

// SLONames are the names of the objectives, in bit order: the label slo
// of tokentap_slo_missed_total, the access log's slo_missed, and /stats.
var SLONames = []string{"ttft", "ttfa", "tpot", "e2e", "failed", "unacked", "qoe"}

// NumSLO is len(SLONames).
const NumSLO = 7

// Has reports whether bit i (an index into SLONames) is set.
func (m SLOMisses) Has(i int) bool { return m&(1<<i) != 0 }

// String lists the missed names, comma separated.
func (m SLOMisses) String() string {
	var b strings.Builder
	for i, n := range SLONames {
		if m.Has(i) {
			if b.Len() > 0 {
				b.WriteByte(',')
			}
			b.WriteString(n)
		}
	}
	return b.String()
}

// Judge sets r.SLOJudged and r.SLOMisses against s (nothing when s is
// zero, or when r was refused for the client's own doing: Outcome.Judged).
// r's timings must be final.
func (s SLO) Judge(r *Record) {
	if s.IsZero() || !r.Outcome.Judged() {
		return
	}
	r.SLOJudged, r.SLOTarget = true, s.Target
	var m SLOMisses
	if r.Outcome != OutcomeOK {
		m |= SLOFailed
	}
	over := func(bit SLOMisses, limit, got time.Duration) {
		if limit > 0 && got >= 0 && got > limit {
			m |= bit
		}
	}
	ttft, ttfa, e2e := r.TTFT, r.TTFA, r.E2E
	if s.Measure != MeasureProxy {
		ttft, ttfa, e2e = either(r.ClientTTFT, ttft), either(r.ClientTTFA, ttfa), either(r.ClientE2E, e2e)
		if r.Unacked {
			m |= SLOUnacked
		}
	}
	over(SLOTTFT, s.TTFT, ttft)
	over(SLOTTFA, s.TTFA, ttfa)
	over(SLOTPOT, s.TPOT, r.TPOT)
	over(SLOE2E, s.E2E, e2e)
	if s.QoE > 0 && r.Reading.Tokens > 0 && r.Reading.QoE < s.QoE {
		m |= SLOQoE
	}
	r.SLOMisses = m
}

// Good reports whether r was judged and met everything.
func (r *Record) Good() bool { return r.SLOJudged && r.SLOMisses == 0 }

// either returns a unless it is Absent, else b.
func either(a, b time.Duration) time.Duration {
	if a >= 0 {
		return a
	}
	return b
}
