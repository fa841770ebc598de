package proxy

import (
	"cmp"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"strings"

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
}

// Balance policies.
const (
	// BalanceWeighted picks at random, in proportion to the weights.
	BalanceWeighted = "weighted"
	// BalanceLeastInflight picks the upstream with the fewest requests in
	// flight, among those with a weight; ties go to the larger weight.
	BalanceLeastInflight = "least_inflight"
)

// member is an upstream of a route at run time.
type member struct {
	name   string
	up     *upstream
	weight int
	row    int // its metric series row
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
			if n := m.up.inflight.Load(); best == nil || n < bestN || n == bestN && w > r.weight(best) {
				best, bestN = m, n
			}
		}
		return best, 0, false
	}
	return r.byWeight(rand.IntN(total)), 0, false
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
