package routing

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"go.uber.org/zap"
)

// Guard stops a canary that is worse than its baseline: from the moment
// both sides have MinRequests since the guard was armed (the config or a
// reset), it weighs all their requests since then once a second, and when
// the candidate's TTFT p95 or E2E p95 exceeds the baseline's by more than
// the allowed share, or its error rate by more than the allowed points,
// with confidence (a sequential test whose false alarms over all its looks
// stay under 1%: stats.WeighGuard), the candidate's weight drops to 0 (it
// takes no new requests; those in flight finish) until a reload or a
// reset.
type Guard struct {
	Candidate, Baseline string
	// Window is 1m, 5m, 15m or 1h (default 5m): how long a sticky key
	// stays counted on its side once a side has seen more than 4,096
	// keys. The guard itself never waits for a window: it weighs the
	// requests since it was armed.
	Window      string
	MinRequests int64
	// MaxTTFTP95Increase and MaxE2EP95Increase are shares (0.1: 10%);
	// MaxErrorRateIncrease is in points of error rate (0.01: one point).
	// 0 leaves that check out.
	MaxTTFTP95Increase, MaxE2EP95Increase, MaxErrorRateIncrease float64
	// Class limits the guard to the requests of one class (Classes): the
	// sides then weigh only those. Empty: every request.
	Class string
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
	candidate *Member
	tripped   atomic.Pointer[GuardStatus] // nil: not tripped
	lastCheck atomic.Int64                // unix nanos of the last check
	armedAt   atomic.Int64                // unix nanos: the sides hold the requests since then
	looks     atomic.Int64                // the looks taken since then (stats.WeighGuard's k)
	// sides are the requests since armedAt of the candidate and the
	// baseline; keys the sticky keys seen on each side.
	sides [2]*stats.GuardSide
	keys  [2]keySet
}

// newGuardState arms a route's guard at now.
func newGuardState(g Guard, now time.Time) *guardState {
	st := &guardState{Guard: g.withDefaults(), sides: [2]*stats.GuardSide{stats.NewGuardSide(), stats.NewGuardSide()}}
	st.armedAt.Store(now.UnixNano())
	return st
}

// side returns the side upstream is on: 0 the candidate, 1 the baseline,
// -1 neither.
func (g *guardState) side(upstream string) int {
	switch upstream {
	case g.Candidate:
		return 0
	case g.Baseline:
		return 1
	}
	return -1
}

// observe adds a finished request of upstream to its side.
func (g *guardState) observe(upstream string, rec *metrics.Record) {
	if g.Class != "" && rec.Class != g.Class {
		return
	}
	if i := g.side(upstream); i >= 0 {
		g.sides[i].Observe(rec)
	}
}

// rearm empties the sides and starts the looks again, at now.
func (g *guardState) rearm(now time.Time) {
	g.sides[0].Reset()
	g.sides[1].Reset()
	g.looks.Store(0)
	g.armedAt.Store(now.UnixNano())
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
	if i := g.side(upstream); i >= 0 {
		g.keys[i].note(key, now.UnixNano(), int64(g.windowLen()))
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

// check takes the guard's next look, at most once per
// guardInterval, once both sides have MinRequests (and, with a sticky
// key, MinKeys distinct keys) since it was armed, and trips it when the
// candidate is worse beyond a limit (stats.WeighGuard), saying so to log.
// route is the name of the route it guards, sticky whether a client
// chooses its side.
func (g *guardState) check(route string, sticky bool, now time.Time, log *zap.Logger) {
	if g == nil || g.tripped.Load() != nil {
		return
	}
	last := g.lastCheck.Load()
	if now.UnixNano()-last < int64(guardInterval) || !g.lastCheck.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	if g.sides[0].Count() < g.MinRequests || g.sides[1].Count() < g.MinRequests {
		return
	}
	if sticky {
		// A client chooses its side: each side needs the requests of
		// enough distinct keys.
		from := g.armedAt.Load()
		if g.keys[0].distinct(from, g.MinKeys) < g.MinKeys || g.keys[1].distinct(from, g.MinKeys) < g.MinKeys {
			return
		}
	}
	look := int(g.looks.Add(1))
	f := stats.WeighGuard(g.sides[0], g.sides[1], look,
		stats.GuardLimits{TTFTP95: g.MaxTTFTP95Increase, E2EP95: g.MaxE2EP95Increase, ErrorRate: g.MaxErrorRateIncrease})
	if !f.Tripped {
		return
	}
	st := &GuardStatus{Route: route, Candidate: g.Candidate, Baseline: g.Baseline, At: now.UTC(), Reason: f.Reason, Values: f.Values}
	if g.tripped.CompareAndSwap(nil, st) {
		log.Warn("canary guard tripped: the candidate takes no new requests", zap.String("route", route),
			zap.String("candidate", g.Candidate), zap.String("baseline", g.Baseline), zap.String("reason", f.Reason),
			zap.Float64("candidate_requests", f.Values["candidate_requests"]), zap.Float64("baseline_requests", f.Values["baseline_requests"]))
	}
}

// GuardState is what the admin listener shows of a route's guard: its
// sides since it was armed, the looks taken, and why it tripped, if it did.
type GuardState struct {
	Route             string       `json:"route"`
	Candidate         string       `json:"candidate"`
	Baseline          string       `json:"baseline"`
	Class             string       `json:"class,omitempty"`
	MinRequests       int64        `json:"min_requests"`
	CandidateRequests int64        `json:"candidate_requests"`
	BaselineRequests  int64        `json:"baseline_requests"`
	Looks             int64        `json:"looks"`
	ArmedAt           time.Time    `json:"armed_at"`
	Tripped           *GuardStatus `json:"tripped"`
}

// Tripped is the route's tripped guard (nil: none, or not tripped).
func (s *Set) Tripped() *GuardStatus {
	if s.guard == nil {
		return nil
	}
	return s.guard.tripped.Load()
}

// GuardState is the state of the route's guard (false: it has none).
func (s *Set) GuardState() (GuardState, bool) {
	g := s.guard
	if g == nil {
		return GuardState{}, false
	}
	return GuardState{Route: s.route, Candidate: g.Candidate, Baseline: g.Baseline, Class: g.Class,
		MinRequests: g.MinRequests, CandidateRequests: g.sides[0].Count(), BaselineRequests: g.sides[1].Count(),
		Looks: g.looks.Load(), ArmedAt: time.Unix(0, g.armedAt.Load()).UTC(), Tripped: g.tripped.Load()}, true
}

// GuardSides are the route's guard's baseline and candidate (false: it
// has none).
func (s *Set) GuardSides() (baseline, candidate string, ok bool) {
	if s.guard == nil {
		return "", "", false
	}
	return s.guard.Baseline, s.guard.Candidate, true
}

// ResetGuard clears the route's tripped guard, re-armed at now: its
// candidate takes requests again. It reports whether one was tripped.
func (s *Set) ResetGuard(now time.Time) bool {
	if s.guard == nil || s.guard.tripped.Swap(nil) == nil {
		return false
	}
	s.guard.rearm(now)
	return true
}

// Validate checks g, the guard of a route whose upstreams are names;
// isClass tells a class's name. Its errors name the field under field.
func (g *Guard) Validate(field func(string) string, names map[string]bool, isClass func(string) bool) error {
	switch {
	case !names[g.Candidate]:
		return conf.Errf(field("guard.candidate"), "%q is not one of the route's upstreams", g.Candidate)
	case !names[g.Baseline] || g.Baseline == g.Candidate:
		return conf.Errf(field("guard.baseline"), "%q is not another of the route's upstreams", g.Baseline)
	case g.Window != "" && g.Window != "1m" && g.Window != "5m" && g.Window != "15m" && g.Window != "1h":
		return conf.Errf(field("guard.window"), "must be 1m, 5m, 15m or 1h, got %q", g.Window)
	case g.MinRequests < 0:
		return conf.Errf(field("guard.min_requests"), "must not be negative")
	case g.MinKeys < 0:
		return conf.Errf(field("guard.min_keys"), "must not be negative")
	case g.MaxTTFTP95Increase == 0 && g.MaxE2EP95Increase == 0 && g.MaxErrorRateIncrease == 0:
		return conf.Errf(field("guard"), "needs at least one limit (max_ttft_p95_increase, max_e2e_p95_increase, max_error_rate_increase)")
	case g.Class != "" && !isClass(g.Class):
		return conf.Errf(field("guard.class"), "%q is not a class (such as in-short.out-long or in-long.out-short.prefix-reused)", g.Class)
	}
	return nil
}
