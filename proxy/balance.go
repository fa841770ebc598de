package proxy

import (
	"hash/maphash"
	"math"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/valyala/fasthttp"
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
	Headers []Header
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

// member is an upstream of a route at run time.
type member struct {
	name   string
	up     *upstream.Backend
	weight int
	row    int // its metric series row
	// why counts the requests sent to it since the configuration, by
	// why; cache is what its backend said of its prompt cache
	// (affinity.go).
	why    [numPickReasons]atomic.Int64
	slot   atomic.Uint64 // slotTime's average, float64 nanoseconds
	cache  cacheTally
	scrape *scraper // nil: no metrics_url
}

// picked is the requests sent to m since the configuration.
func (m *member) picked() int64 {
	var n int64
	for i := range m.why {
		n += m.why[i].Load()
	}
	return n
}

// Why a request went to its upstream, for /stats (Overload.Why).
type pickReason uint8

const (
	pickBalance       pickReason = iota // the route's balance: weighted or least in flight
	pickSticky                          // the tenant's or header's sticky key
	pickLeastTTFT                       // the least predicted first token
	pickProbe                           // a probe of an upstream that looks worse
	pickExplore                         // an upstream without a prediction yet
	pickPrefix                          // its prompt's upstream (sticky: prefix)
	pickSpill                           // its prompt's upstream was past its bound: the next with room
	pickOverObjective                   // no upstream would serve it within its objective: one with a free place
	pickFreeInTime                      // the soonest would queue it: one in time with a free place
	numPickReasons
)

var pickReasonNames = [numPickReasons]string{"balance", "sticky", "least_ttft", "probe", "explore", "prefix", "prefix_moved", "over_objective", "free_in_time"}

// held is the requests upstream m holds as a new one is sent: its k in
// flight from tokentap, and those the backend reports beyond them.
func (m *member) held(now time.Time, k int) int { return k + m.scrape.others(now, k) }

// predictTTFT is the first token a request of in input tokens would get
// on m now, with k of tokentap's requests in flight there. Where the
// backend reports a queue
// (metrics_url), the prediction is at least its turn in that queue: the
// idle first token plus, for each request waiting ahead and this one, a
// slot's time shared by the slots running, the turn a model learned from
// tokentap's own traffic alone cannot know.
func (m *member) predictTTFT(now time.Time, k, in int) (time.Duration, bool) {
	model := m.up.Gate.Model
	t, _, ok := model.Predict(m.held(now, k), in)
	if !ok {
		return t, false
	}
	if st, fresh := m.scrape.fresh(now); fresh && st.Waiting > 0 {
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
func (m *member) slotTime() time.Duration { return time.Duration(math.Float64frombits(m.slot.Load())) }

// noteSlot adds a finished request's time on the backend to slotTime's
// average (each a tenth of it).
func (m *member) noteSlot(d time.Duration) {
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

// pick chooses the upstream of a request of route r. With Sticky, the
// tenant or the header's value maps to one upstream, the same each time
// while the weights stay, and users spread by the weights.
//
// key is the sticky key's hash and keyed whether there was one: the guard
// counts the distinct keys behind each side (a client that chooses its
// side must not decide alone).
func (r *route) pick(tenant string, h *fasthttp.RequestHeader) (m *member, key uint64, keyed bool) {
	if len(r.members) == 1 {
		return r.members[0], 0, false
	}
	var sticky []byte
	switch {
	case r.Sticky == "tenant":
		sticky = []byte(tenant)
	case strings.HasPrefix(r.Sticky, "header:"):
		sticky = h.Peek(r.Sticky[len("header:"):])
	}
	total := 0
	for _, m := range r.members {
		total += r.weight(m)
	}
	if len(sticky) > 0 {
		key = maphash.Bytes(stickySeed, sticky)
		return r.byWeight(int(key % uint64(total))), key, true
	}
	if r.Balance == BalanceLeastInflight {
		var best *member
		var bestN int64
		for _, m := range r.members {
			w := r.weight(m)
			if w == 0 {
				continue
			}
			if n := m.up.Inflight.Load(); best == nil || n < bestN || n == bestN && w > r.weight(best) {
				best, bestN = m, n
			}
		}
		return best, 0, false
	}
	return r.byWeight(rand.IntN(total)), 0, false
}

// leastTTFT chooses the upstream of a least_ttft route for a request of in
// input tokens (in < 0: unknown): the one predicted to give its first
// token soonest, ties to the larger weight. An upstream without a
// prediction is tried for exploreShare of requests (all of them while
// none has one: then the fewest in flight); probeShare of requests go to
// another upstream with a weight, chosen by weight. roll is uniform in
// [0, 1). With a first-token objective (0: none), the request's place
// weighs the others' too: one the soonest upstream would queue goes to
// one that has a free place in its batch and serves it in time (it holds
// up nobody there), and one no upstream serves in time goes where it
// delays nobody who would be (harmless). It returns the chosen upstream
// and its prediction (-1: none).
func (r *route) leastTTFT(now time.Time, in int, roll float64, objective time.Duration) (*member, time.Duration, pickReason) {
	var best, fresh, calm *member
	bestT, calmT, total, eligible := time.Duration(-1), time.Duration(-1), 0, 0
	bestFree := false
	var buf [8]upstreamView
	views := buf[:0] // the upstreams with a prediction, for harmless
	for _, m := range r.members {
		w := r.weight(m)
		if w == 0 {
			continue
		}
		total += w
		eligible++
		k := int(m.up.Inflight.Load())
		t, ok := m.predictTTFT(now, k, in)
		if !ok {
			if fresh == nil || k < int(fresh.up.Inflight.Load()) {
				fresh = m
			}
			continue
		}
		free := objective > 0 && m.free(now, k)
		views = append(views, upstreamView{m: m, t: t, free: free})
		if free && t <= m.inTime(objective) && (calm == nil || t < calmT) {
			calm, calmT = m, t
		}
		if best == nil || t < bestT || t == bestT && w > r.weight(best) {
			best, bestT, bestFree = m, t, free
		}
	}
	late := best != nil && objective > 0 && bestT > best.inTime(objective)
	switch {
	case best == nil:
		return fresh, -1, pickExplore
	case fresh != nil && roll < exploreShare:
		return fresh, -1, pickExplore
	case fresh != nil && late:
		// The known best would not serve it in time: the unknown may.
		return fresh, -1, pickExplore
	case late && eligible > 1 && best.servesInTime(in, objective):
		// Nowhere would it get its first token in time. Sent to the best,
		// it would only deepen the queue of an upstream that serves the
		// others in time: it goes where it holds up nobody who would be
		// served in time, the soonest such upstream: one with a free place
		// in its batch (below its learned knee), else one that serves
		// nobody in time even idle (its queue's requests miss anyway);
		// with neither, to the best. (Where the best serves nobody in time
		// either, there is nobody to spare: the soonest it is.)
		if m, t, ok := harmless(views, in, objective, best, bestT); ok {
			return m, t, pickOverObjective
		}
	case calm != nil && calm != best && !bestFree:
		// The best would queue it behind a full batch, lengthening every
		// later request's wait there; another serves it in time now.
		return calm, calmT, pickFreeInTime
	case eligible > 1 && roll < probeShare:
		// Any other upstream, by weight.
		at := int(roll / probeShare * float64(total-r.weight(best)))
		for _, m := range r.members {
			if w := r.weight(m); m != best && w > 0 {
				if at < w {
					t, _ := m.predictTTFT(now, int(m.up.Inflight.Load()), in)
					return m, t, pickProbe
				}
				at -= w
			}
		}
	}
	return best, bestT, pickLeastTTFT
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
func (m *member) servesInTime(in int, objective time.Duration) bool {
	idle, _, ok := m.up.Gate.Model.Predict(0, in)
	return ok && idle <= objective
}

// free reports whether m has a free place in its batch for a request sent
// now with k of tokentap's in flight there: the requests it holds at most
// its model's learned knee.
func (m *member) free(now time.Time, k int) bool {
	return float64(m.held(now, k)) <= m.up.Gate.Model.Knee()
}

// inTime is the most a prediction of m may say for a request to count on
// its first token within objective: the objective less the prediction's
// usual error there (its mean absolute error, relative), so that a
// request predicted at the edge, half of which would miss, is not sent
// into a queue it would lengthen for the others.
func (m *member) inTime(objective time.Duration) time.Duration {
	_, absErr, n := m.up.Gate.Model.Calibration()
	if n < 20 {
		return objective
	}
	return time.Duration(float64(objective) / (1 + min(absErr, 0.5)))
}

// upstreamView is what leastTTFT read of an upstream with a prediction
// for the request: the prediction, and whether a place is free in its
// batch (with an objective).
type upstreamView struct {
	m    *member
	t    time.Duration
	free bool
}

// harmless is the upstream of views other than best where a request of in
// input tokens, which nowhere gets its first token within objective,
// delays nobody who would: predicted soonest among those with a free
// place in their batch, else among those that give no request its first
// token in time even idle, where its first token is predicted within
// lateBound times the objective and lateSpread times bestT, the soonest's.
func harmless(views []upstreamView, in int, objective time.Duration, best *member, bestT time.Duration) (*member, time.Duration, bool) {
	var free, hopeless *member
	freeT, hopelessT := time.Duration(-1), time.Duration(-1)
	for _, v := range views {
		m, t := v.m, v.t
		switch {
		case m == best:
		case v.free:
			if free == nil || t < freeT {
				free, freeT = m, t
			}
		case t <= lateBound*objective && float64(t) <= lateSpread*float64(bestT) && (hopeless == nil || t < hopelessT) && !m.servesInTime(in, objective):
			hopeless, hopelessT = m, t
		}
	}
	if free != nil {
		return free, freeT, true
	}
	return hopeless, hopelessT, hopeless != nil
}

// late reports whether route r's upstream is chosen once the request's
// body is read: by the model it names, or by its input's predicted TTFT.
func (r *route) late() bool {
	if len(r.members) < 2 {
		return len(r.Models) > 0
	}
	return len(r.Models) > 0 || r.Sticky == StickyPrefix || r.Balance == BalanceLeastTTFT && r.Sticky == ""
}

// predicts reports whether route r's upstreams keep a prediction and show
// in /stats' overload table: for overload control, to balance by it, or
// beside prefix affinity.
func (r *route) predicts() bool {
	if r.Overload != nil || r.Balance == BalanceLeastTTFT || r.Sticky == StickyPrefix {
		return true
	}
	for _, m := range r.members {
		if m.scrape != nil {
			return true
		}
	}
	return false
}

// cacheReported reports whether a backend of route r said what its
// prompt cache served.
func (r *route) cacheReported() bool {
	for _, m := range r.members {
		if m.cache.reported.Load() > 0 {
			return true
		}
	}
	return false
}

// weight is m's share of new requests now: its configured weight, or 0
// for the candidate of a tripped guard (unless no other upstream takes
// requests: they keep flowing).
func (r *route) weight(m *member) int {
	if g := r.guard; g != nil && m == g.candidate && r.weights > m.weight && g.tripped.Load() != nil {
		return 0
	}
	return m.weight
}

// byWeight returns the member whose share of [0, the weights now) holds at.
func (r *route) byWeight(at int) *member {
	for _, m := range r.members {
		w := r.weight(m)
		if at < w {
			return m
		}
		at -= w
	}
	return r.members[len(r.members)-1]
}

// stickySeed hashes sticky keys; one per process, so a user stays on one
// upstream across reloads that keep the weights.
var stickySeed = maphash.MakeSeed()
