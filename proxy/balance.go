package proxy

import (
	"hash/maphash"
	"math/rand/v2"
	"strings"
	"sync/atomic"

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
	name     string
	up       *upstream
	weight   int
	row      int          // its metric series row
	inflight atomic.Int64 // requests sent to it and not finished
}

// pick chooses the upstream of a request of route r. With Sticky, the
// tenant or the header's value maps to one upstream, the same each time
// while the weights stay, and users spread by the weights.
func (r *route) pick(tenant string, h *fasthttp.RequestHeader) *member {
	if len(r.members) == 1 {
		return r.members[0]
	}
	var key []byte
	switch {
	case r.Sticky == "tenant":
		key = []byte(tenant)
	case strings.HasPrefix(r.Sticky, "header:"):
		key = h.Peek(r.Sticky[len("header:"):])
	}
	total := r.weights
	if r.guard != nil && r.guard.tripped.Load() != nil {
		total -= r.guard.candidate.weight
		if total <= 0 {
			total = r.weights // nothing else takes requests: keep them flowing
		}
	}
	if len(key) > 0 {
		return r.byWeight(int(maphash.Bytes(stickySeed, key)%uint64(total)), total != r.weights)
	}
	if r.Balance == BalanceLeastInflight {
		var best *member
		var bestN int64
		for _, m := range r.members {
			if m.weight == 0 || total != r.weights && r.excluded(m) {
				continue
			}
			if n := m.inflight.Load(); best == nil || n < bestN || n == bestN && m.weight > best.weight {
				best, bestN = m, n
			}
		}
		return best
	}
	return r.byWeight(rand.IntN(total), total != r.weights)
}

// byWeight returns the member whose share of [0, total) holds at; with
// skip, the tripped guard's candidate has no share.
func (r *route) byWeight(at int, skip bool) *member {
	for _, m := range r.members {
		if skip && r.excluded(m) {
			continue
		}
		if at < m.weight {
			return m
		}
		at -= m.weight
	}
	return r.members[len(r.members)-1]
}

// stickySeed hashes sticky keys; one per process, so a user stays on one
// upstream across reloads that keep the weights.
var stickySeed = maphash.MakeSeed()
