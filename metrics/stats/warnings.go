package stats

import (
	"fmt"
	"time"
)

// WarnOptions are the thresholds of the warnings. Zero fields take the
// defaults noted.
type WarnOptions struct {
	// MinRequests: a group (or each side of a trend) needs this many
	// requests before it can warn (default 20).
	MinRequests int64
	// OverheadP95: gateway overhead p95 above it warns (default 10 ms).
	OverheadP95 time.Duration
	// QueueShare: admission queue p50 at or above this share of TTFT p50
	// (E2E p50 without tokens) warns (default 0.5).
	QueueShare float64
	// TrendThroughput and TrendTTFT: output tokens/s of the last one to
	// two minutes at least TrendThroughput × the three minutes before,
	// while TTFT p95 rose to at least TrendTTFT × its level then (defaults
	// 1.1 and 1.2).
	TrendThroughput, TrendTTFT float64
}

func (w WarnOptions) withDefaults() WarnOptions {
	if w.MinRequests <= 0 {
		w.MinRequests = 20
	}
	if w.OverheadP95 <= 0 {
		w.OverheadP95 = 10 * time.Millisecond
	}
	if w.QueueShare <= 0 {
		w.QueueShare = 0.5
	}
	if w.TrendThroughput <= 0 {
		w.TrendThroughput = 1.1
	}
	if w.TrendTTFT <= 0 {
		w.TrendTTFT = 1.2
	}
	return w
}

// The kinds of warning.
const (
	WarnBuffering = "buffering"       // tokens arrive in bursts: a hop before tokentap buffers the stream
	WarnBatching  = "batching_ttft"   // throughput up while TTFT tails rose
	WarnQueue     = "queue_dominates" // admission queue time dominates TTFT
	WarnOverhead  = "overhead"        // tokentap's own time above the threshold
	WarnGoodput   = "goodput"         // goodput under its SLO target
	WarnGuard     = "guard_tripped"   // a canary guard stopped its candidate
	WarnShedding  = "shedding"        // overload control refuses requests
	WarnHeld      = "tokens_held"     // streams stall, mostly held by one hop
)

// heldBecause says what a hop that holds most stalled streams' tokens
// usually is.
var heldBecause = map[string]string{
	"upstream": "it sends in bursts or pauses mid-stream",
	"gateway":  "tokentap wrote late what it had read (is its CPU starved?)",
	"client":   "slow readers or a congested path",
}

// heldWarning warns when at least 5% of a group's streams stalled (a wait
// of a pace or more) and one hop held at least 60% of the streams whose
// reader waited.
func heldWarning(g *Group, w WarnOptions) (vals map[string]float64, msg string, ok bool) {
	rd := g.Reading
	if rd == nil || rd.Streams < w.MinRequests || rd.StallRate < 0.05 {
		return nil, "", false
	}
	for _, hop := range []string{"upstream", "gateway", "client"} {
		if share := rd.HeldShare[hop]; share >= 0.6 {
			of := float64(rd.HeldBy[hop]) / float64(rd.Streams)
			vals = map[string]float64{"held_share": share, "streams_share": round3(of), "stall_rate": rd.StallRate, "streams": float64(rd.Streams)}
			return vals, fmt.Sprintf("tokens held by the %s in %.0f%% of streams (%.0f%% of those whose reader waited; %.0f%% stalled): %s",
				hop, 100*of, 100*share, 100*rd.StallRate, heldBecause[hop]), true
		}
	}
	return nil, "", false
}

// Warning says what looks wrong, where, and the numbers that say so.
type Warning struct {
	Kind     string `json:"kind"`
	Route    string `json:"route"`
	Model    string `json:"model"`
	Tenant   string `json:"tenant"`
	Upstream string `json:"upstream"`
	Message  string `json:"message"`
	// Values are the figures the warning was raised on, by name.
	Values map[string]float64 `json:"values"`
}

func where(k Key) string {
	s := "route " + k.Route
	if k.Model != "" {
		s += ", model " + k.Model
	}
	if k.Tenant != "" {
		s += ", tenant " + k.Tenant
	}
	if k.Upstream != "" {
		s += ", upstream " + k.Upstream
	}
	return s
}

func (e *Engine) warnings(q Query, groups []Group, list []*group, s int64, now time.Time) []Warning {
	w := *e.warn.Load()
	out := []Warning{}
	add := func(kind string, k Key, vals map[string]float64, format string, args ...any) {
		out = append(out, Warning{Kind: kind, Route: k.Route, Model: k.Model, Tenant: k.Tenant, Upstream: k.Upstream,
			Message: where(k) + ": " + fmt.Sprintf(format, args...), Values: vals})
	}
	for i := range groups {
		g := &groups[i]
		k := g.key()
		// Buffering: most gaps near zero while tokens did take time to
		// come: either every token lands with the last (TTFT ≈ E2E) or
		// they come in bursts (mean gap far above the median).
		if g.TTFT.Count >= w.MinRequests && g.ITL.Count > 0 && g.ITL.P50 < 1 {
			bursty := g.ITL.Mean >= 4*max(g.ITL.P50, 0.05) && g.ITL.P99 >= 20
			late := g.E2E.P50 > 0 && g.TTFT.P50 >= 0.8*g.E2E.P50 && g.TTFT.P50 >= 20
			if bursty || late {
				add(WarnBuffering, k, map[string]float64{"ttft_p50_ms": g.TTFT.P50, "itl_p50_ms": g.ITL.P50, "itl_mean_ms": g.ITL.Mean, "itl_p99_ms": g.ITL.P99, "e2e_p50_ms": g.E2E.P50},
					"tokens arrive in bursts (ITL p50 %.2f ms, mean %.1f ms, p99 %.1f ms) while TTFT p50 is %.0f ms of E2E p50 %.0f ms: a hop between the backend and tokentap is buffering the stream",
					g.ITL.P50, g.ITL.Mean, g.ITL.P99, g.TTFT.P50, g.E2E.P50)
			}
		}
		// Queue: the admission queue holds requests for most of their wait.
		base, baseName := g.TTFT.P50, "TTFT"
		if g.TTFT.Count == 0 {
			base, baseName = g.E2E.P50, "E2E"
		}
		if g.Queue.Count >= w.MinRequests && g.Queue.P50 >= 5 && g.Queue.P50 >= w.QueueShare*base {
			add(WarnQueue, k, map[string]float64{"queue_p50_ms": g.Queue.P50, "ttft_p50_ms": g.TTFT.P50, "e2e_p50_ms": g.E2E.P50, "share": round3(g.Queue.P50 / max(base, 0.001))},
				"admission queue p50 %.0f ms is %.0f%% of %s p50 %.0f ms: the tenant's limits are tighter than its traffic",
				g.Queue.P50, 100*g.Queue.P50/max(base, 0.001), baseName, base)
		}
		if lim := ms(w.OverheadP95); g.Overhead.Count >= w.MinRequests && g.Overhead.P95 > lim {
			add(WarnOverhead, k, map[string]float64{"overhead_p95_ms": g.Overhead.P95, "threshold_ms": lim},
				"gateway overhead p95 %.2f ms is above %.2f ms", g.Overhead.P95, lim)
		}
		if vals, msg, ok := heldWarning(g, w); ok {
			add(WarnHeld, k, vals, "%s", msg)
		}
		if gp := g.Goodput; gp.Target != nil && gp.Ratio != nil && gp.Judged >= w.MinRequests && *gp.Ratio < *gp.Target {
			worst, n := "", int64(0)
			for name, c := range gp.Missed {
				if c > n || c == n && name < worst {
					worst, n = name, c
				}
			}
			add(WarnGoodput, k, map[string]float64{"goodput_ratio": *gp.Ratio, "target": *gp.Target, "judged": float64(gp.Judged)},
				"goodput %.1f%% is under its target %.1f%% (%d of %d requests good; most missed: %s, %d)",
				100**gp.Ratio, 100**gp.Target, gp.Good, gp.Judged, worst, n)
		}
	}
	out = append(out, e.trends(q, list, s, now, w)...)
	return out
}

// trends compares, per route (within q's filters), the last one to two
// minutes with the three minutes before: throughput up while TTFT p95 rose
// is batching paid for in first-token latency.
func (e *Engine) trends(q Query, list []*group, s int64, now time.Time, w WarnOptions) []Warning {
	type pair struct{ recent, before agg }
	byRoute := map[string]*pair{}
	var order []string
	var recentFrom, beforeFrom int64
	for _, g := range list {
		if !q.matches(g.key) || g.key.Shadow { // the route's own traffic only
			continue
		}
		p := byRoute[g.key.Route]
		if p == nil {
			p = &pair{newAgg(), newAgg()}
			byRoute[g.key.Route] = p
			order = append(order, g.key.Route)
		}
		g.mu.Lock()
		recentFrom, beforeFrom = g.w.recentAndBefore(&p.recent, &p.before, s)
		g.mu.Unlock()
	}
	var out []Warning
	for _, route := range order {
		p := byRoute[route]
		if p.recent.d[mTTFT].count() < w.MinRequests || p.before.d[mTTFT].count() < w.MinRequests {
			continue
		}
		recentSpan := e.span(recentFrom, now).Seconds()
		beforeSpan := slotStart(recentFrom).Sub(maxTime(slotStart(beforeFrom), e.start)).Seconds()
		if beforeSpan <= 0 {
			continue
		}
		tpsR, tpsB := float64(p.recent.outTokens)/recentSpan, float64(p.before.outTokens)/beforeSpan
		ttftR, ttftB := p.recent.d[mTTFT].quantile(0.95), p.before.d[mTTFT].quantile(0.95)
		if tpsB > 0 && ttftB > 0 && tpsR >= w.TrendThroughput*tpsB && ttftR >= w.TrendTTFT*ttftB && ttftR-ttftB >= 5 {
			k := Key{Route: route}
			out = append(out, Warning{Kind: WarnBatching, Route: route,
				Message: fmt.Sprintf("%s: output tokens/s %+.0f%% (%.1f → %.1f) while TTFT p95 %+.0f%% (%.0f → %.0f ms), the last %.0f s against the %.0f s before: more batching is costing first-token latency",
					where(k), 100*(tpsR/tpsB-1), tpsB, tpsR, 100*(ttftR/ttftB-1), ttftB, ttftR, recentSpan, beforeSpan),
				Values: map[string]float64{"output_tokens_per_s_before": round3(tpsB), "output_tokens_per_s_recent": round3(tpsR),
					"ttft_p95_ms_before": round3(ttftB), "ttft_p95_ms_recent": round3(ttftR)}})
		}
	}
	return out
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// GuardWarning is the warning that shows a tripped guard.
func GuardWarning(g TrippedGuard) Warning {
	return Warning{Kind: WarnGuard, Route: g.Route, Upstream: g.Candidate, Values: g.Values,
		Message: fmt.Sprintf("route %s: the canary guard stopped upstream %s (no new requests) at %s: %s, against %s",
			g.Route, g.Candidate, g.At.Format(time.RFC3339), g.Reason, g.Baseline)}
}
