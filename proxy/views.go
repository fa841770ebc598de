package proxy

import (
	"cmp"
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/admission/shed"
	"go.uber.org/zap"
)

// What the admin listener, the dashboard and the CLI see of the running
// configuration: the guards, the overload table, the sides a comparison
// weighs. Each reads the snapshot as it is now and holds nothing.

// Guards returns the tripped guards of the running config.
func (p *Proxy) Guards() []GuardStatus {
	out := []GuardStatus{}
	for _, r := range p.snap.Load().routes {
		if r.guard != nil {
			if st := r.guard.tripped.Load(); st != nil {
				out = append(out, *st)
			}
		}
	}
	return out
}

// GuardStates returns the state of every guard of the running config.
func (p *Proxy) GuardStates() []GuardState {
	out := []GuardState{}
	for _, r := range p.snap.Load().routes {
		if g := r.guard; g != nil {
			out = append(out, GuardState{Route: r.Name, Candidate: g.Candidate, Baseline: g.Baseline, Class: g.Class,
				MinRequests: g.MinRequests, CandidateRequests: g.sides[0].Count(), BaselineRequests: g.sides[1].Count(),
				Looks: g.looks.Load(), ArmedAt: time.Unix(0, g.armedAt.Load()).UTC(), Tripped: g.tripped.Load()})
		}
	}
	return out
}

// ResetGuard clears the tripped guard of route (all routes when ""): its
// candidate takes requests again. It reports whether one was tripped.
func (p *Proxy) ResetGuard(route string) bool {
	reset := false
	for _, r := range p.snap.Load().routes {
		if r.guard != nil && (route == "" || r.Name == route) && r.guard.tripped.Swap(nil) != nil {
			r.guard.rearm(p.statsNow())
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
		if !r.predicts() && !r.cacheReported() {
			continue
		}
		for _, m := range r.members {
			k := m.held(now, int(m.up.Inflight.Load()))
			st := m.up.Gate.Status(now, k, shed.Objectives{TTFT: r.slo.TTFT, TPOT: r.slo.TPOT})
			o := stats.Overload{Route: r.Name, Upstream: m.name, Enforcing: r.Overload != nil && r.Overload.Shed, Known: st.Known, InFlight: k,
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
			fillShares(&o, r, m)
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
	if rt == nil || len(rt.members) < 2 {
		return "", "", "", false
	}
	if g := rt.guard; g != nil {
		return g.Baseline, g.Candidate, "the guard's baseline (A) and candidate (B)", true
	}
	byWeight := slices.Clone(rt.members)
	slices.SortStableFunc(byWeight, func(x, y *member) int { return cmp.Compare(y.weight, x.weight) })
	if sh := rt.shadow; sh != nil {
		for _, m := range byWeight {
			if m != sh.member {
				return m.name, sh.member.name, "the route's main upstream (A, the largest weight) and its shadow (B)", true
			}
		}
	}
	return byWeight[0].name, byWeight[1].name, "the two upstreams of largest weight, the larger (the first configured on a tie) as A, the baseline", true
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
