package ratelimit

import "time"

// Requests in flight across a reload that adds or takes away the shared
// store: each keeps its concurrency slot, moved to where the new
// configuration counts (handOver), so a reload never lets a tenant past
// its max_concurrent. A store's lease becomes a count in this replica's
// limiters (its release is sent to the store, which frees it there); a
// count here becomes a lease of the new store (renewed at once, then with
// the others). A moved request's release frees its slot only: the tokens
// it reserved stay counted where they were taken.

// hold registers adm among st's admissions in flight. st is locked.
func (st *tenantState) hold(adm *admission) *admission {
	if st.holds == nil {
		st.holds = map[*admission]struct{}{}
	}
	st.holds[adm] = struct{}{}
	return adm
}

// handOver moves st's admissions in flight to where a configuration with
// the shared store (nil: none) counts them: its leases, or this replica's
// limiters; then counts them there. It reports whether any became a lease
// (shared must renew them). st is locked.
func (st *tenantState) handOver(shared *store, now time.Time) bool {
	leased := false
	for adm := range st.holds {
		switch {
		case shared == nil && (adm.lease != "" || adm.fallback):
			if adm.lease != "" {
				// Freed in the store it was taken in (sent before that
				// store closes): the other replicas see the slot go.
				all, rl := st.limitsOn(adm.routeName)
				adm.store.release(st.t.Name, adm.routeName, all, rl, adm.lease, usage{}, usage{})
			}
			*adm = admission{routeName: adm.routeName, moved: true}
		case shared != nil && adm.lease == "" && !adm.fallback:
			adm.lease, adm.store, adm.moved = shared.hold(st.t, adm.routeName), shared, true
			leased = true
		}
	}
	st.recount(now)
	return leased
}

// limitsOn returns the tenant's limits and its limits on route, nil where
// it has none: what a release sends along. st is locked.
func (st *tenantState) limitsOn(route string) (all, rl *Limits) {
	if l := st.t.Limits; l.any() {
		all = &l
	}
	if l, ok := st.t.Routes[route]; ok && l.any() {
		rl = &l
	}
	return all, rl
}

// recount sets the requests in flight of st's limiters here (its own and
// its routes') from its admissions held here, and points each at its
// route's limiter now (a reload may have made it anew). st is locked.
func (st *tenantState) recount(now time.Time) {
	if st.all != nil {
		st.all.inflight = 0
	}
	for _, rl := range st.routes {
		rl.inflight = 0
	}
	for adm := range st.holds {
		if adm.lease != "" || adm.fallback {
			continue
		}
		if st.all != nil {
			st.all.inflight++
		}
		if adm.route = st.routeLimiter(adm.routeName, now); adm.route != nil {
			adm.route.inflight++
		}
	}
}
