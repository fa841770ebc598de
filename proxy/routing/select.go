package routing

import (
	"cmp"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"github.com/valyala/fasthttp"
)

// Selector is one policy of a route's choice of upstream, as a chain's
// link: it chooses for r (c's Member, Why and what it knew) and reports
// true, or passes to the next. A route's chain ends with Balance, which
// always chooses.
type Selector interface {
	Select(s *Set, r *Request, c *Choice) bool
}

// Request is what the choice knows of a request: when, its body once read
// (its prompt's prefix, its input), its tenant and header (sticky keys),
// and its first-token objective (0: none).
type Request struct {
	Now       time.Time
	Body      []byte
	Tenant    string
	Header    *fasthttp.RequestHeader
	Objective time.Duration
}

// Choice is a request's upstream and why it was chosen, with the TTFT
// predicted there where a prediction chose it (-1: none) and the sticky
// key that chose it (Keyed: there was one).
type Choice struct {
	Member *Member
	Why    Reason
	TTFT   time.Duration
	Key    uint64
	Keyed  bool
}

// Choose runs the route's chain for r and counts the choice by why.
func (s *Set) Choose(r *Request) Choice {
	c := Choice{TTFT: -1}
	for _, sel := range s.chain {
		if sel.Select(s, r, &c) {
			break
		}
	}
	c.Member.why[c.Why].Add(1)
	return c
}

// PrefixAffinity sends requests whose prompts begin alike to one
// upstream, its load bounded (affinity.go): once the body is read and it
// holds a prompt.
type PrefixAffinity struct{}

func (PrefixAffinity) Select(s *Set, r *Request, c *Choice) bool {
	if !s.Late() {
		return false
	}
	key, ok := promptKey(r.Body)
	if !ok {
		return false
	}
	c.Member, c.Why = s.byPrefix(key, r.Now)
	c.Key, c.Keyed = key, true
	return true
}

// byPrefix returns the upstream for a prompt key at now: where the key
// was sent before while that upstream's requests in flight, with this
// one, stay within affinityLoad times its weight's share (and one request
// more, so that a quiet route keeps its keys in place), or where its
// model says one more request there waits for no other (waitsForNone:
// its batch has room, and its cached prefix saves it the prefill); else
// the first on the ring from the key within its bound, where the key then
// stays; else the least loaded.
func (s *Set) byPrefix(key uint64, now time.Time) (*Member, Reason) {
	a := s.aff
	a.mu.Lock()
	defer a.mu.Unlock()
	var total int64
	weights := 0
	for i, m := range s.members {
		a.load[i] = m.Up.Inflight.Load()
		if w := s.Weight(m); w > 0 {
			total += a.load[i]
			weights += w
		}
	}
	fits := func(i int) bool {
		m := s.members[i]
		w := s.Weight(m)
		return w > 0 && (float64(a.load[i]+1) <= affinityLoad*float64(total+1)*float64(w)/float64(weights)+1 || waitsForNone(m, a.load[i]))
	}
	send := func(i int) *Member {
		a.place(key, i, now)
		return s.members[i]
	}
	p, placed := a.keys[key]
	if placed && fits(p.at) {
		return send(p.at), pickPrefix
	}
	start, _ := slices.BinarySearchFunc(a.ring, key, func(p ringPoint, k uint64) int { return cmp.Compare(p.hash, k) })
	least := -1
	for j := range a.ring {
		i := a.ring[(start+j)%len(a.ring)].at
		if fits(i) {
			if placed && i != p.at {
				return send(i), pickSpill
			}
			return send(i), pickPrefix
		}
		if s.Weight(s.members[i]) > 0 && (least < 0 || a.load[i] < a.load[least]) {
			least = i
		}
	}
	if least < 0 {
		return s.byWeight(0), pickSpill
	}
	return s.members[least], pickSpill
}

// LeastTTFT sends a request to the upstream predicted to give its first
// token soonest (leastTTFT), once its body is read: its input counts.
type LeastTTFT struct{}

func (LeastTTFT) Select(s *Set, r *Request, c *Choice) bool {
	if !s.Late() {
		return false
	}
	m, t, why := s.leastTTFT(r.Now, len(r.Body)/4, rand.Float64(), r.Objective)
	c.TTFT = t
	if m == nil {
		return false
	}
	c.Member, c.Why = m, why
	return true
}

// Balance is the route's balance (weighted, or least in flight) under its
// stickiness to a tenant or a header's value: the chain's last link.
type Balance struct{}

func (Balance) Select(s *Set, r *Request, c *Choice) bool {
	c.Member, c.Key, c.Keyed = s.pick(r.Tenant, r.Header)
	c.Why = pickBalance
	if c.Keyed {
		c.Why = pickSticky
	}
	return true
}

// pick chooses the upstream of a request by the route's balance. With
// Sticky, the tenant or the header's value maps to one upstream, the same
// each time while the weights stay, and users spread by the weights.
//
// key is the sticky key's hash and keyed whether there was one: the guard
// counts the distinct keys behind each side (a client that chooses its
// side must not decide alone).
func (s *Set) pick(tenant string, h *fasthttp.RequestHeader) (m *Member, key uint64, keyed bool) {
	if len(s.members) == 1 {
		return s.members[0], 0, false
	}
	var sticky []byte
	switch {
	case s.sticky == "tenant":
		sticky = []byte(tenant)
	case strings.HasPrefix(s.sticky, "header:"):
		sticky = h.Peek(s.sticky[len("header:"):])
	}
	total := 0
	for _, m := range s.members {
		total += s.Weight(m)
	}
	if len(sticky) > 0 {
		key = maphash.Bytes(stickySeed, sticky)
		return s.byWeight(int(key % uint64(total))), key, true
	}
	if s.balance == BalanceLeastInflight {
		var best *Member
		var bestN int64
		for _, m := range s.members {
			w := s.Weight(m)
			if w == 0 {
				continue
			}
			if n := m.Up.Inflight.Load(); best == nil || n < bestN || n == bestN && w > s.Weight(best) {
				best, bestN = m, n
			}
		}
		return best, 0, false
	}
	return s.byWeight(rand.IntN(total)), 0, false
}

// stickySeed hashes sticky keys; one per process, so a user stays on one
// upstream across reloads that keep the weights.
var stickySeed = maphash.MakeSeed()

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
func (s *Set) leastTTFT(now time.Time, in int, roll float64, objective time.Duration) (*Member, time.Duration, Reason) {
	var best, fresh, calm *Member
	bestT, calmT, total, eligible := time.Duration(-1), time.Duration(-1), 0, 0
	bestFree := false
	var buf [8]upstreamView
	views := buf[:0] // the upstreams with a prediction, for harmless
	for _, m := range s.members {
		w := s.Weight(m)
		if w == 0 {
			continue
		}
		total += w
		eligible++
		k := int(m.Up.Inflight.Load())
		t, ok := m.PredictTTFT(now, k, in)
		if !ok {
			if fresh == nil || k < int(fresh.Up.Inflight.Load()) {
				fresh = m
			}
			continue
		}
		free := objective > 0 && m.free(now, k)
		views = append(views, upstreamView{m: m, t: t, free: free})
		if free && t <= m.inTime(objective) && (calm == nil || t < calmT) {
			calm, calmT = m, t
		}
		if best == nil || t < bestT || t == bestT && w > s.Weight(best) {
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
		at := int(roll / probeShare * float64(total-s.Weight(best)))
		for _, m := range s.members {
			if w := s.Weight(m); m != best && w > 0 {
				if at < w {
					t, _ := m.PredictTTFT(now, int(m.Up.Inflight.Load()), in)
					return m, t, pickProbe
				}
				at -= w
			}
		}
	}
	return best, bestT, pickLeastTTFT
}

// upstreamView is what leastTTFT read of an upstream with a prediction
// for the request: the prediction, and whether a place is free in its
// batch (with an objective).
type upstreamView struct {
	m    *Member
	t    time.Duration
	free bool
}

// harmless is the upstream of views other than best where a request of in
// input tokens, which nowhere gets its first token within objective,
// delays nobody who would: predicted soonest among those with a free
// place in their batch, else among those that give no request its first
// token in time even idle, where its first token is predicted within
// lateBound times the objective and lateSpread times bestT, the soonest's.
func harmless(views []upstreamView, in int, objective time.Duration, best *Member, bestT time.Duration) (*Member, time.Duration, bool) {
	var free, hopeless *Member
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
