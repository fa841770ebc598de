// Package routing is where a request goes: its route, matched on its
// normalised path (NormalizePath, PrefixMatch) and the models routes name
// (Serves), and its upstream among the route's (a Set), chosen by a chain
// of selectors, each choosing or passing to the next: prefix affinity
// (PrefixAffinity), the least predicted first token (LeastTTFT), then the
// route's balance under its stickiness (Balance). Around the choice: what
// each upstream's backend reports of its queue (Scraper), what it said of
// its prompt cache (CacheTally), and the guard that stops a canary worse
// than its baseline (Guard). It knows nothing of exchanges: a request is
// what Request says of it.
package routing

import (
	"math"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/proxy/upstream"
)

// Upstream is one backend of a route with several (Route.Upstreams).
type Upstream struct {
	// Name labels the upstream's records, metrics (label upstream) and
	// /stats groups; unique in its route.
	Name string
	// URL is the backend's base URL, as Route.Upstream.
	URL string
	// Weight is the upstream's share of new requests, relative to the
	// route's other weights; 0 takes none.
	Weight int
	// MetricsURL is the backend's Prometheus metrics, scraped every second
	// for the requests it runs and holds waiting and its KV cache's use
	// (scrape.go); empty: none.
	MetricsURL string
	// Headers are set on every request sent to it, over the route's of
	// the same name (proxy/upstream).
	Headers []upstream.Header
	// Protocol is how it is spoken to: "http/1.1" ("": the default) or
	// "h2c", HTTP/2 with prior knowledge (proxy/upstream/h2c.go).
	Protocol string
}

// Balance policies.
const (
	// BalanceWeighted picks at random, in proportion to the weights.
	BalanceWeighted = "weighted"
	// BalanceLeastInflight picks the upstream with the fewest requests in
	// flight, among those with a weight; ties go to the larger weight.
	BalanceLeastInflight = "least_inflight"
	// BalanceLeastTTFT picks the upstream with the least predicted time to
	// first token for this request (its input, each upstream's in flight
	// and what its requests lived: proxy/predict), among those with a
	// weight; a small share probes the others (leastTTFT).
	BalanceLeastTTFT = "least_ttft"
)

// StickyPrefix is Route.Sticky's prefix affinity: requests whose prompts
// begin alike go to one upstream, its load bounded (affinity.go).
const StickyPrefix = "prefix"

// probeShare is the share of a least_ttft route's requests sent to an
// upstream other than the predicted best, so that one that recovered is
// seen to and wins its traffic back; exploreShare is that share while an
// upstream has no prediction yet (a new one, or one unused for long).
const (
	probeShare   = 0.02
	exploreShare = 0.2
)

// Member is an upstream of a route at run time: its backend, its weight,
// its metric row, and what it was told and keeps of its requests.
type Member struct {
	Name   string
	Up     *upstream.Backend
	Weight int
	Row    int // its metric series row
	// why counts the requests sent to it since the configuration, by
	// why; Cache is what its backend said of its prompt cache
	// (affinity.go).
	why    [numReasons]atomic.Int64
	slot   atomic.Uint64 // slotTime's average, float64 nanoseconds
	Cache  CacheTally
	Scrape *Scraper // nil: no metrics_url
}

// picked is the requests sent to m since the configuration.
func (m *Member) picked() int64 {
	var n int64
	for i := range m.why {
		n += m.why[i].Load()
	}
	return n
}

// Why a request went to its upstream, for /stats (Overload.Why).
type Reason uint8

const (
	pickBalance       Reason = iota // the route's balance: weighted or least in flight
	pickSticky                      // the tenant's or header's sticky key
	pickLeastTTFT                   // the least predicted first token
	pickProbe                       // a probe of an upstream that looks worse
	pickExplore                     // an upstream without a prediction yet
	pickPrefix                      // its prompt's upstream (sticky: prefix)
	pickSpill                       // its prompt's upstream was past its bound: the next with room
	pickOverObjective               // no upstream would serve it within its objective: one with a free place
	pickFreeInTime                  // the soonest would queue it: one in time with a free place
	numReasons
)

var reasonNames = [numReasons]string{"balance", "sticky", "least_ttft", "probe", "explore", "prefix", "prefix_moved", "over_objective", "free_in_time"}

// Held is the requests upstream m holds as a new one is sent: its k in
// flight from tokentap, and those the backend reports beyond them.
func (m *Member) Held(now time.Time, k int) int { return k + m.Scrape.Others(now, k) }

// PredictTTFT is the first token a request of in input tokens would get
// on m now, with k of tokentap's requests in flight there. Where the
// backend reports a queue
// (metrics_url), the prediction is at least its turn in that queue: the
// idle first token plus, for each request waiting ahead and this one, a
// slot's time shared by the slots running, the turn a model learned from
// tokentap's own traffic alone cannot know.
func (m *Member) PredictTTFT(now time.Time, k, in int) (time.Duration, bool) {
	model := m.Up.Gate.Model
	t, _, ok := model.Predict(m.Held(now, k), in)
	if !ok {
		return t, false
	}
	if st, fresh := m.Scrape.fresh(now); fresh && st.Waiting > 0 {
		if slot := m.slotTime(); slot > 0 {
			idle, _, _ := model.Predict(0, in)
			turn := time.Duration((st.Waiting + 1) * float64(slot) / max(st.Running, 1))
			t = max(t, idle+turn)
		}
	}
	return t, true
}

// slotTime is how long m's requests hold the backend lately: an average
// of their time there (arrival to end, tokentap's queue left out).
func (m *Member) slotTime() time.Duration { return time.Duration(math.Float64frombits(m.slot.Load())) }

// NoteSlot adds a finished request's time on the backend to slotTime's
// average (each a tenth of it).
func (m *Member) NoteSlot(d time.Duration) {
	for {
		old := m.slot.Load()
		v := math.Float64frombits(old)
		if v == 0 {
			v = float64(d)
		} else {
			v += 0.1 * (float64(d) - v)
		}
		if m.slot.CompareAndSwap(old, math.Float64bits(v)) {
			return
		}
	}
}

// lateBound and lateSpread bound what a late request is made to wait to
// spare the others: sent to an upstream that serves nobody in time, its
// first token is predicted within lateBound times its objective and
// within lateSpread times its prediction at the soonest upstream (bestT).
// Unbounded, such an upstream's queue grows with every late request it
// takes, and their tail with it. On the simulated pair of
// TestLeastTTFTGoodputSimulated (150 ms objective; at 60%, 80% and 90% of
// the joint capacity) these keep 1.29x, 1.12x and 1.02x fewest in
// flight's goodput with a TTFT p99 of 237, 465 and 702 ms against its 288,
// 500 and 841. Looser, the tail is the slow upstream's queue (3 times the
// objective alone: 286 ms at 60%); tighter, the soonest upstream's queue
// takes the late requests and its own miss (a spread of 2.25: 0.97x at
// 90%; 2 times the objective alone: 0.85x).
const (
	lateBound  = 3
	lateSpread = 2.5
)

// servesInTime reports whether m, idle, gives a request of in input
// tokens its first token within objective.
func (m *Member) servesInTime(in int, objective time.Duration) bool {
	idle, _, ok := m.Up.Gate.Model.Predict(0, in)
	return ok && idle <= objective
}

// free reports whether m has a free place in its batch for a request sent
// now with k of tokentap's in flight there: the requests it holds at most
// its model's learned knee.
func (m *Member) free(now time.Time, k int) bool {
	return float64(m.Held(now, k)) <= m.Up.Gate.Model.Knee()
}

// inTime is the most a prediction of m may say for a request to count on
// its first token within objective: the objective less the prediction's
// usual error there (its mean absolute error, relative), so that a
// request predicted at the edge, half of which would miss, is not sent
// into a queue it would lengthen for the others.
func (m *Member) inTime(objective time.Duration) time.Duration {
	_, absErr, n := m.Up.Gate.Model.Calibration()
	if n < 20 {
		return objective
	}
	return time.Duration(float64(objective) / (1 + min(absErr, 0.5)))
}
