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
}

// IsZero reports whether s sets nothing.
func (s SLO) IsZero() bool { return s == SLO{} }

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
	return s
}

// SLOMisses is a set of missed objectives, one bit per SLOName.
type SLOMisses uint8

// The objectives a request can miss; SLOFailed is a request that did not
// succeed at all.
const (
	SLOTTFT SLOMisses = 1 << iota
	SLOTTFA
	SLOTPOT
	SLOE2E
	SLOFailed
)

// SLONames are the names of the objectives, in bit order: the label slo
// of tokentap_slo_missed_total, the access log's slo_missed, and /stats.
var SLONames = []string{"ttft", "ttfa", "tpot", "e2e", "failed"}

// NumSLO is len(SLONames).
const NumSLO = 5

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
// zero). r's timings must be final.
func (s SLO) Judge(r *Record) {
	if s.IsZero() {
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
	over(SLOTTFT, s.TTFT, r.TTFT)
	over(SLOTTFA, s.TTFA, r.TTFA)
	over(SLOTPOT, s.TPOT, r.TPOT)
	over(SLOE2E, s.E2E, r.E2E)
	r.SLOMisses = m
}

// Good reports whether r was judged and met everything.
func (r *Record) Good() bool { return r.SLOJudged && r.SLOMisses == 0 }
