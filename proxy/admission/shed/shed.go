// Package shed decides, request by request, whether an upstream can serve
// one more in time. Past what a backend can serve, forwarding every
// request only makes its queue longer: every user's first token comes
// late while the backend is fully busy, and goodput falls to nothing. A
// Gate holds one upstream's model (proxy/predict: what a request would
// live there, learned from what its requests lived at each number in
// flight, no capacity configured) and judges each new request by its
// priority and objectives: a request whose predicted TTFT or TPOT would
// use more than its priority's share of its waiting budget is refused at
// once, instead of joining a queue that makes everyone late.
//
//	g := shed.New(time.Now)
//	v := g.Judge(time.Now(), inflight, inputTokens, shed.Standard, objectives, firstByteTimeout)
//	if v.Shed { /* refuse, Retry-After: v.RetryAfter */ }
//	g.Model.Observe(inflightAtStart, inputTokens, ttft, tpot, v.TTFT) // once measured
package shed

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/proxy/admission/predict"
)

// Priority is a request's place under overload: critical requests are
// served as long as the backend can serve them at all, sheddable ones go
// first.
type Priority uint8

// The priorities, most important first (the Gateway API Inference
// Extension's bands).
const (
	Critical Priority = iota
	Standard
	Sheddable
	numPriorities
)

var priorityNames = [numPriorities]string{"critical", "standard", "sheddable"}

func (p Priority) String() string { return priorityNames[p] }

// ParsePriority reads a priority's name; anything else is Standard, and
// ok false.
func ParsePriority(s string) (p Priority, ok bool) {
	for i, n := range priorityNames {
		if n == s {
			return Priority(i), true
		}
	}
	return Standard, false
}

// share is the part, by priority, of a request's waiting budget (its TTFT
// or TPOT objective less what an idle upstream gives) its prediction may
// use before it is refused while the upstream's queue stands (see Gate).
// A critical request may wait up to twice its budget: it is served late
// rather than refused, and refused only where critical requests alone come
// faster than the upstream serves them (a queue of them would grow to the
// first-byte timeout, every one failed), and never while requests of
// lower priorities are let through. Without a standing queue a burst
// passes: a standard request is refused only when it would miss its
// objective outright, a critical one only past its first-byte timeout.
//
// While critical requests come (within CriticalSeen) and a queue stands,
// the lower priorities leave them room: the levels critical requests
// hold (criticalRoom), and no level past a quarter beyond the highest
// measured lately (beyond), where the model's curve is a guess.
var (
	share      = [numPriorities]float64{Critical: 2, Standard: 0.85, Sheddable: 0.6}
	shareBurst = [numPriorities]float64{Critical: 0, Standard: 1, Sheddable: 0.6}
)

// A queue stands when, over the last StandingWindow or two, even its
// shortest (the fewest in flight any arrival found) would have made a
// request wait more than standingShare of its TTFT budget: it does not
// drain between arrivals, which a burst does (CoDel's reading of a
// queue, on the model's prediction); or when requests come faster than
// the upstream serves them (outpaced): the load is more than overloaded
// times what it serves, shed or not (the queue shedding keeps short does
// not stand, and the load still does), or, before anything is refused,
// more than outrun times (a queue building from a cold start).
const (
	StandingWindow = time.Second
	standingShare  = 0.25
	overloaded     = 1.2
	outrun         = 2.0
)

// CriticalSeen is how long after a critical request lower priorities go
// on leaving headroom for the next.
const CriticalSeen = 10 * time.Second

// threshold is the most of objective a prediction may reach, using at
// most share of the budget above idle, what the request would live on an
// idle upstream; 0 when there is no objective or no budget: a request an
// idle upstream would not serve in time either (a long prompt's prefill)
// is not refused, which would hasten nothing.
func threshold(objective, idle time.Duration, share float64) time.Duration {
	if objective <= 0 || idle < 0 || idle >= objective {
		return 0
	}
	return idle + time.Duration(share*float64(objective-idle))
}

// Objectives is what a request is judged by (0: none).
type Objectives struct{ TTFT, TPOT time.Duration }

// Gate is one upstream's overload gate. It is safe for concurrent use.
type Gate struct {
	// Model is what the upstream's streams live: their first token and
	// time per output token; Whole what its whole (not streamed)
	// responses live, their time taken as Model's TTFT.
	Model    *predict.Model
	Whole    *predict.Model
	critical atomic.Int64 // when a critical request last came (unix ns)

	mu sync.Mutex
	// The fewest in flight an arrival found in this window (from winAt)
	// and in the one before.
	winAt          time.Time
	minNow, minWas int
	// arrivals is the requests judged a second, critArrivals the critical
	// ones (exponential averages over about 5 s, as the model's
	// completion rate), at arrivedAt.
	arrivals, critArrivals float64
	arrivedAt              time.Time
	standing               bool      // the last judgement found the queue standing
	knownAt                time.Time // since when the model has believed something
	// The refusals: how many, and a second (an exponential average over
	// about 5 s, as the arrivals), at lastShed.
	sheds    int64
	shedRate float64
	lastShed time.Time
	// knownShedRate is shedRate of the refusals made once the model had
	// believed something for a StandingWindow (outpaced): those of a cold
	// start, made knowing nothing, say nothing of the load.
	knownShedRate float64
	// lower is when a request of a lower priority than critical was last
	// let through.
	lower time.Time
}

// Refused counts a request refused on the gate's word at now.
func (g *Gate) Refused(now time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.lastShed.IsZero() {
		d := math.Exp(-now.Sub(g.lastShed).Seconds() / 5)
		g.shedRate *= d
		g.knownShedRate *= d
	}
	g.sheds, g.shedRate, g.lastShed = g.sheds+1, g.shedRate+1.0/5, now
	if !g.knownAt.IsZero() && now.Sub(g.knownAt) >= StandingWindow {
		g.knownShedRate += 1.0 / 5
	}
}

// Status is what a gate shows of itself: what its model believes, how
// well it predicted, and what it refused.
type Status struct {
	// Known: the model believes something; the rest of its figures
	// are meaningless without.
	Known bool
	// Knee is the in-flight level where the batch is full; Limit the most
	// in flight at which a standard request of the usual size is
	// predicted to meet the objectives given (−1: not even one); TTFT and
	// TPOT the prediction at the in-flight count given.
	Knee       float64
	Limit      int
	TTFT, TPOT time.Duration
	// Bias and AbsErr are the model's mean relative error (positive: too
	// long) and mean absolute relative error, over Judged predictions.
	Bias, AbsErr float64
	Judged       int
	// Arrivals and Completions are requests a second, judged and
	// completed; Standing: the last judgement found the queue standing.
	Arrivals, Completions float64
	Standing              bool
	// Sheds is the refusals counted, ShedRate their rate a second, and
	// LastShed the last one's time.
	Sheds    int64
	ShedRate float64
	LastShed time.Time
}

// Status returns the gate's status at now with k requests in flight,
// its limit for objectives obj.
func (g *Gate) Status(now time.Time, k int, obj Objectives) Status {
	m := g.Model
	st := Status{Limit: -1, Completions: m.CompletionRate()}
	st.Bias, st.AbsErr, st.Judged = m.Calibration()
	g.mu.Lock()
	st.Standing, st.Sheds, st.LastShed = g.standing, g.sheds, g.lastShed
	st.Arrivals = g.arrivals * math.Exp(-now.Sub(g.arrivedAt).Seconds()/5)
	st.ShedRate = g.shedRate * math.Exp(-now.Sub(g.lastShed).Seconds()/5)
	g.mu.Unlock()
	st.TTFT, st.TPOT, st.Known = m.Predict(k, -1)
	if !st.Known {
		return st
	}
	st.Knee = m.Knee()
	idleTTFT, idleTPOT, _ := m.Predict(0, -1)
	if limit, ok := m.Limit(-1, threshold(obj.TTFT, idleTTFT, share[Standard]), threshold(obj.TPOT, idleTPOT, share[Standard])); ok {
		st.Limit = limit
	}
	return st
}

// shortest notes an arrival that found k in flight at now and returns the
// fewest any arrival found over the last window or two.
func (g *Gate) shortest(now time.Time, k int, p Priority, arrive bool) (fewest int, rate float64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !arrive {
		return min(g.minNow, g.minWas), g.arrivals * math.Exp(-now.Sub(g.arrivedAt).Seconds()/5)
	}
	if !g.arrivedAt.IsZero() {
		d := math.Exp(-now.Sub(g.arrivedAt).Seconds() / 5)
		g.arrivals *= d
		g.critArrivals *= d
	}
	g.arrivals, g.arrivedAt = g.arrivals+1.0/5, now
	if p == Critical {
		g.critArrivals += 1.0 / 5
	}
	switch since := now.Sub(g.winAt); {
	case since >= 2*StandingWindow || since < 0:
		g.winAt, g.minWas, g.minNow = now, k, k // nothing came for a while
	case since >= StandingWindow:
		g.winAt, g.minWas, g.minNow = now, g.minNow, k
	default:
		g.minNow = min(g.minNow, k)
	}
	return min(g.minNow, g.minWas), g.arrivals
}

// New returns a gate with an empty model on the clock now (nil: time.Now).
func New(now func() time.Time) *Gate { return &Gate{Model: predict.New(now), Whole: predict.New(now)} }

// Verdict is a request's judgement.
type Verdict struct {
	// Known: the model believed something; TTFT and TPOT are its
	// prediction (TPOT −1: none).
	Known      bool
	TTFT, TPOT time.Duration
	// Shed: the request would miss its objectives and refusing it
	// shortens the others' wait; RetryAfter is when the queue is
	// predicted to have drained below where it would be served.
	Shed       bool
	RetryAfter time.Duration
}

// Judge judges a request of in input tokens (−1: unknown) and priority p
// arriving at now with k requests in flight on the upstream: refused when
// its prediction passes its priority's threshold (share), or for any
// request when no first token would come before firstByte (0: no
// timeout). Nothing is refused while the model believes nothing.
func (g *Gate) Judge(now time.Time, k, in int, p Priority, obj Objectives, firstByte time.Duration) Verdict {
	return g.judge(g.Model, true, now, k, in, p, obj, firstByte)
}

// JudgeWhole judges a request whose response is whole (not streamed) as
// Judge does a stream, by its predicted time to the whole response (Whole)
// against its E2E objective e2e. It is judged once its body says it does
// not stream, which Judge, on the headers alone, cannot know; the
// arrivals it counts are Judge's.
func (g *Gate) JudgeWhole(now time.Time, k, in int, p Priority, e2e, timeout time.Duration) Verdict {
	return g.judge(g.Whole, false, now, k, in, p, Objectives{TTFT: e2e}, timeout)
}

// judge is Judge on model m, counting the request as an arrival with
// arrive.
func (g *Gate) judge(m *predict.Model, arrive bool, now time.Time, k, in int, p Priority, obj Objectives, firstByte time.Duration) Verdict {
	if p == Critical {
		g.critical.Store(now.UnixNano())
	}
	fewest, arrivals := g.shortest(now, k, p, arrive)
	ttft, tpot, ok := m.Predict(k, in)
	v := Verdict{Known: ok, TTFT: ttft, TPOT: tpot, RetryAfter: time.Second}
	reserved := now.UnixNano()-g.critical.Load() < int64(CriticalSeen)
	// What an idle upstream gives, and whether a queue stands; with
	// nothing believed, what is known is that nothing is (a cold start).
	var idleTTFT, idleTPOT time.Duration
	standing := true
	if ok {
		idleTTFT, idleTPOT, _ = m.Predict(0, in)
		shortest, _, _ := m.Predict(fewest, in)
		st := threshold(obj.TTFT, idleTTFT, standingShare)
		standing = st > 0 && shortest > st || g.outpaced(now, arrivals)
	}
	g.mu.Lock()
	g.standing = standing
	if !ok {
		g.knownAt = time.Time{}
	}
	g.mu.Unlock()
	shares := &shareBurst
	if standing {
		shares = &share
	}
	var ttftAt, tpotAt time.Duration
	if s := shares[p]; s > 0 {
		ttftAt, tpotAt = threshold(obj.TTFT, idleTTFT, s), threshold(obj.TPOT, idleTPOT, s)
	}
	if firstByte > 0 && (ttftAt == 0 || firstByte < ttftAt) {
		ttftAt = firstByte // no first token would come in time at all
	}
	switch {
	case ok && (ttftAt > 0 && ttft > ttftAt || tpotAt > 0 && tpot > tpotAt):
		v.Shed = p != Critical || !g.lowerLetThrough(now) // lower priorities go first
	case p == Critical || !standing || !reserved:
	case k > beyond(m.Measured()):
		v.Shed = true
	case ok:
		lim, _ := m.Limit(in, ttftAt, tpotAt)
		v.Shed = k > lim-g.criticalRoom(now, k)
	}
	if !v.Shed && p != Critical {
		g.mu.Lock()
		g.lower = now
		g.mu.Unlock()
	}
	if v.Shed && ok {
		limit, _ := m.Limit(in, ttftAt, tpotAt)
		v.RetryAfter = m.DrainTime(k, limit)
	}
	return v
}

// beyond is the most in flight a request of a lower priority than
// critical is sent at while critical requests come and a queue stands,
// from the highest level a first token was measured at lately (−1: none):
// a quarter further (one level at least, four at the start: Envoy's
// adaptive concurrency starts at three). Past the levels measured the
// model's curve is a guess, and a queue found there is one the critical
// requests wait in; from a cold start under overload this is what keeps
// that queue short while the model learns the curve.
func beyond(measured int) int { return max(4, measured+max(1, measured/4)) }

// criticalRoom is the levels the critical requests hold with k in flight:
// their share of the requests served times k (Little's law, the time in
// the system alike), rounded up.
func (g *Gate) criticalRoom(now time.Time, k int) int {
	g.mu.Lock()
	c := g.critArrivals * math.Exp(-now.Sub(g.arrivedAt).Seconds()/5)
	g.mu.Unlock()
	served := g.servedRate()
	if c <= 0 || served <= 0 {
		return 0
	}
	return int(math.Ceil(min(c/served, 1) * float64(max(k, 1))))
}

// outpaced reports requests coming faster than the upstream serves them
// (arrivals: requests judged a second): the gate refuses more than
// overloaded−1 times as many as the upstream serves (the load, shed or
// not, is more than overloaded times what it serves), or requests arrive
// more than outrun times as fast. Arrivals are not held against
// overloaded times the served: a first token is heard a prefill after
// its request was judged, and on a busy machine a wait for a processor
// later still, so while the load rises the lag alone reads as a queue
// (from a cold start at 0.6 of the capacity, first tokens heard 0.4 s
// late: arrivals 1.2 to 1.4 times the served for seconds), and the
// refusals it caused held it there. A refusal counts as it is made, but
// only once the model has believed something for a StandingWindow: a
// cold start's refusals, made knowing nothing, held the queue standing
// for the 5 s of the rate (14 of 115 refused in one run over loopback on
// a busy machine).
//
// In that first StandingWindow arrivals against overloaded times the
// served are read all the same: a cold start is a standing queue until
// known not to be one (at three times the capacity, arrivals are 1.5 to
// 1.9 times the first tokens in the first 0.3 s, and a queue let build
// then is one the critical requests wait in).
func (g *Gate) outpaced(now time.Time, arrivals float64) bool {
	served := g.servedRate()
	g.mu.Lock()
	refused := g.knownShedRate * math.Exp(-now.Sub(g.lastShed).Seconds()/5)
	if g.knownAt.IsZero() {
		g.knownAt = now
	}
	young := now.Sub(g.knownAt) < StandingWindow
	g.mu.Unlock()
	if young {
		return arrivals > overloaded*served
	}
	return refused > (overloaded-1)*served || arrivals > outrun*served
}

// servedRate is the requests a second the upstream took in lately,
// streams and whole responses.
func (g *Gate) servedRate() float64 { return g.Model.ServedRate() + g.Whole.ServedRate() }

// lowerLetThrough reports a request of a lower priority than critical let
// through within StandingWindow.
func (g *Gate) lowerLetThrough(now time.Time) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return !g.lower.IsZero() && now.Sub(g.lower) < StandingWindow
}
