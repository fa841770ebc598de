package proxy

import (
	"cmp"
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/admission/shed"
	"github.com/tokentap/tokentap/proxy/routing"
	"go.uber.org/zap"
)

// What the admin listener, the dashboard and the CLI see of the running
// configuration: the guards, the overload table, the sides a comparison
// weighs. Each reads the snapshot as it is now and holds nothing.

// Guards returns the tripped guards of the running config.
func (p *Proxy) Guards() []GuardStatus {
	out := []GuardStatus{}
	for _, r := range p.snap.Load().routes {
		if st := r.set.Tripped(); st != nil {
			out = append(out, *st)
		}
	}
	return out
}

// GuardStates returns the state of every guard of the running config.
func (p *Proxy) GuardStates() []GuardState {
	out := []GuardState{}
	for _, r := range p.snap.Load().routes {
		if st, ok := r.set.GuardState(); ok {
			out = append(out, st)
		}
	}
	return out
}

// ResetGuard clears the tripped guard of route (all routes when ""): its
// candidate takes requests again. It reports whether one was tripped.
func (p *Proxy) ResetGuard(route string) bool {
	reset := false
	for _, r := range p.snap.Load().routes {
		if (route == "" || r.Name == route) && r.set.ResetGuard(p.statsNow()) {
			reset = true
			p.log.Info("canary guard reset", zap.String("route", r.Name))
		}
	}
	return reset
}

// Overload is what overload control, least_ttft and prefix affinity see
// of each upstream of the routes that have them (and of routes whose
// backends report their prompt caches), now (for /stats and the
// dashboard), in the routes' order.
func (p *Proxy) Overload() []stats.Overload {
	out := []stats.Overload{}
	now := p.now()
	for _, r := range p.snap.Load().routes {
		if !r.predicts() && !r.set.CacheReported() {
			continue
		}
		for _, m := range r.set.Members() {
			k := m.Held(now, int(m.Up.Inflight.Load()))
			st := m.Up.Gate.Status(now, k, shed.Objectives{TTFT: r.slo.TTFT, TPOT: r.slo.TPOT})
			o := stats.Overload{Route: r.Name, Upstream: m.Name, Enforcing: r.Overload != nil && r.Overload.Shed, Known: st.Known, InFlight: k,
				Limit: st.Limit, PredictedTTFTMs: -1, PredictedTPOTMs: -1, Bias: st.Bias, AbsError: st.AbsErr, Judged: st.Judged,
				ArrivalsPerS: st.Arrivals, CompletionsPerS: st.Completions, Standing: st.Standing,
				Shed: st.Sheds, ShedPerS: st.ShedRate, LastShed: st.LastShed,
				Shedding: !st.LastShed.IsZero() && now.Sub(st.LastShed) < 10*time.Second}
			if st.Known {
				o.Knee, o.PredictedTTFTMs = st.Knee, float64(st.TTFT)/1e6
				if st.TPOT >= 0 {
					o.PredictedTPOTMs = float64(st.TPOT) / 1e6
				}
			}
			r.set.FillShares(&o, m)
			out = append(out, o)
		}
	}
	return out
}

// CompareSides picks the two upstreams of route name that a comparison weighs,
// by one rule for every view (the dashboard, tokentap compare, /stats with
// compare=auto), and says which rule chose them: the guard's baseline (A)
// and candidate (B); else the main upstream (the largest weight, the first
// configured on a tie) and the shadow; else the two of largest weight, the
// larger (or the first configured) as A, the baseline. ok is false for a
// route without two upstreams.
func (p *Proxy) CompareSides(name string) (a, b, rule string, ok bool) {
	var rt *route
	for _, r := range p.snap.Load().routes {
		if r.Name == name {
			rt = r
		}
	}
	if rt == nil || len(rt.set.Members()) < 2 {
		return "", "", "", false
	}
	if baseline, candidate, ok := rt.set.GuardSides(); ok {
		return baseline, candidate, "the guard's baseline (A) and candidate (B)", true
	}
	byWeight := slices.Clone(rt.set.Members())
	slices.SortStableFunc(byWeight, func(x, y *routing.Member) int { return cmp.Compare(y.Weight, x.Weight) })
	if sh := rt.shadow; sh != nil {
		for _, m := range byWeight {
			if m != sh.member {
				return m.Name, sh.member.Name, "the route's main upstream (A, the largest weight) and its shadow (B)", true
			}
		}
	}
	return byWeight[0].Name, byWeight[1].Name, "the two upstreams of largest weight, the larger (the first configured on a tie) as A, the baseline", true
}
