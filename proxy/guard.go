package proxy

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"go.uber.org/zap"
)

// Guard stops a canary that is worse than its baseline: when, over Window
// and with at least MinRequests on each side, the candidate's TTFT p95 or
// E2E p95 exceeds the baseline's by more than the allowed share, or its
// error rate by more than the allowed points, the candidate's weight
// drops to 0 (it takes no new requests; those in flight finish) until a
// reload or a reset.
type Guard struct {
	Candidate, Baseline string
	// Window is 1m, 5m, 15m or 1h (default 5m).
	Window      string
	MinRequests int64
	// MaxTTFTP95Increase and MaxE2EP95Increase are shares (0.1: 10%);
	// MaxErrorRateIncrease is in points of error rate (0.01: one point).
	// 0 leaves that check out.
	MaxTTFTP95Increase, MaxE2EP95Increase, MaxErrorRateIncrease float64
	// MinKeys: on a route whose sticky key a client chooses (sticky
	// tenant or header), a side is weighed only once requests of at least
	// this many distinct keys are in its window (default 10), so that no
	// one client decides. Without a sticky key the split is random and no
	// client can choose its side: it does not apply.
	MinKeys int
}

// withDefaults returns g with its zero fields set to their defaults.
func (g Guard) withDefaults() Guard {
	if g.MinRequests == 0 {
		g.MinRequests = 200
	}
	if g.MinKeys == 0 {
		g.MinKeys = defaultGuardMinKeys
	}
	return g
}

// defaultGuardMinKeys is Guard.MinKeys when unset.
const defaultGuardMinKeys = 10

// guardState is a route's guard at run time.
type guardState struct {
	Guard
	candidate *member
	tripped   atomic.Pointer[GuardStatus] // nil: not tripped
	lastCheck atomic.Int64                // unix nanos of the last check
	armedAt   atomic.Int64                // unix nanos: checks begin a window after it
	// keys are the sticky keys seen on each side (candidate, baseline).
	keys [2]keySet
}

// keySet is when each sticky key (its hash) was last seen on a side,
// bounded: past maxGuardKeys it makes room by forgetting keys outside the
// window, and otherwise does not grow (it holds more than any MinKeys).
type keySet struct {
	mu   sync.Mutex
	last map[uint64]int64 // key hash → unix nanos
}

// maxGuardKeys bounds a side's keySet.
const maxGuardKeys = 4096

func (k *keySet) note(key uint64, now, window int64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.last == nil {
		k.last = map[uint64]int64{}
	}
	if _, ok := k.last[key]; !ok && len(k.last) >= maxGuardKeys {
		for h, t := range k.last {
			if t < now-window {
				delete(k.last, h)
			}
		}
		if len(k.last) >= maxGuardKeys {
			return
		}
	}
	k.last[key] = now
}

// distinct counts the keys seen since from, up to enough.
func (k *keySet) distinct(from int64, enough int) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, t := range k.last {
		if t >= from {
			if n++; n >= enough {
				break
			}
		}
	}
	return n
}

// noteKey records that a request of the sticky key (its hash) went to
// upstream, when that is the guard's candidate or baseline.
func (g *guardState) noteKey(upstream string, key uint64, now time.Time) {
	switch upstream {
	case g.Candidate:
		g.keys[0].note(key, now.UnixNano(), int64(g.windowLen()))
	case g.Baseline:
		g.keys[1].note(key, now.UnixNano(), int64(g.windowLen()))
	}
}

// windowLen is the length of a guard window.
func (g *Guard) windowLen() time.Duration {
	switch g.Window {
	case "1m":
		return time.Minute
	case "15m":
		return 15 * time.Minute
	case "1h":
		return time.Hour
	}
	return 5 * time.Minute
}

// GuardStatus is what /stats and the dashboard show of a tripped guard.
type GuardStatus = stats.TrippedGuard

// guardInterval is how often a route's guard weighs its two sides, at
// most: a check merges a window of sketches.
const guardInterval = time.Second

// checkGuard weighs the route's candidate against its baseline, at most
// once per guardInterval, and trips the guard when a limit is passed.
func (p *Proxy) checkGuard(r *route, now time.Time) {
	g := r.guard
	if g == nil || g.tripped.Load() != nil || now.UnixNano() < g.armedAt.Load()+int64(g.windowLen()) {
		return // a window holds data from before the config or the reset
	}
	last := g.lastCheck.Load()
	if now.UnixNano()-last < int64(guardInterval) || !g.lastCheck.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	if r.Sticky != "" {
		// A client chooses its side: each side needs the requests of
		// enough distinct keys in its window.
		from := now.UnixNano() - int64(g.windowLen())
		if g.keys[0].distinct(from, g.MinKeys) < g.MinKeys || g.keys[1].distinct(from, g.MinKeys) < g.MinKeys {
			return
		}
	}
	c := p.stats.Summarize(r.Name, g.Candidate, g.Window)
	b := p.stats.Summarize(r.Name, g.Baseline, g.Window)
	if c.Count < g.MinRequests || b.Count < g.MinRequests {
		return
	}
	vals := map[string]float64{"candidate_requests": float64(c.Count), "baseline_requests": float64(b.Count),
		"candidate_ttft_p95_ms": c.TTFTP95, "baseline_ttft_p95_ms": b.TTFTP95, "candidate_e2e_p95_ms": c.E2EP95, "baseline_e2e_p95_ms": b.E2EP95,
		"candidate_error_rate": c.ErrorRate(), "baseline_error_rate": b.ErrorRate()}
	var reason string
	switch {
	case g.MaxTTFTP95Increase > 0 && b.TTFTP95 > 0 && c.TTFTP95 > b.TTFTP95*(1+g.MaxTTFTP95Increase):
		reason = fmt.Sprintf("TTFT p95 %.1f ms is %+.1f%% of the baseline's %.1f ms (limit %+.1f%%)", c.TTFTP95, 100*(c.TTFTP95/b.TTFTP95-1), b.TTFTP95, 100*g.MaxTTFTP95Increase)
	case g.MaxE2EP95Increase > 0 && b.E2EP95 > 0 && c.E2EP95 > b.E2EP95*(1+g.MaxE2EP95Increase):
		reason = fmt.Sprintf("E2E p95 %.1f ms is %+.1f%% of the baseline's %.1f ms (limit %+.1f%%)", c.E2EP95, 100*(c.E2EP95/b.E2EP95-1), b.E2EP95, 100*g.MaxE2EP95Increase)
	case g.MaxErrorRateIncrease > 0 && c.ErrorRate()-b.ErrorRate() > g.MaxErrorRateIncrease:
		reason = fmt.Sprintf("error rate %.2f%% against the baseline's %.2f%% (limit +%.2f points)", 100*c.ErrorRate(), 100*b.ErrorRate(), 100*g.MaxErrorRateIncrease)
	default:
		return
	}
	st := &GuardStatus{Route: r.Name, Candidate: g.Candidate, Baseline: g.Baseline, At: now.UTC(), Reason: reason, Values: vals}
	if g.tripped.CompareAndSwap(nil, st) {
		p.log.Warn("canary guard tripped: the candidate takes no new requests", zap.String("route", r.Name),
			zap.String("candidate", g.Candidate), zap.String("baseline", g.Baseline), zap.String("reason", reason),
			zap.Int64("candidate_requests", c.Count), zap.Int64("baseline_requests", b.Count))
	}
}

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

// ResetGuard clears the tripped guard of route (all routes when ""): its
// candidate takes requests again. It reports whether one was tripped.
func (p *Proxy) ResetGuard(route string) bool {
	reset := false
	for _, r := range p.snap.Load().routes {
		if r.guard != nil && (route == "" || r.Name == route) && r.guard.tripped.Swap(nil) != nil {
			r.guard.armedAt.Store(p.statsNow().UnixNano())
			reset = true
			p.log.Info("canary guard reset", zap.String("route", r.Name))
		}
	}
	return reset
}
