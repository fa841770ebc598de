package ratelimit

// What the admitter shows of its state (a tenant's quotas left, in flight
// and queued, the tenants tracked, its store's state) and what it lets go
// (idle tenants evicted).

import (
	"time"
)

// Quota is one limit as the x-ratelimit-* headers describe it.
type Quota struct {
	Set       bool
	Limit     int64
	Remaining int64
	Reset     time.Duration // until the limit is back to full
}

// Quotas returns the tenant's request and token quotas, from its own
// limits or, when it has none, from route's. With a shared store it
// returns none: the levels live in the store, and this replica's would
// mislead.
func (a *Admitter) Quotas(tenant, route string) (requests, tokens Quota) {
	if a.shared != nil {
		return
	}
	st := a.lock(tenant)
	defer st.mu.Unlock()
	now := a.now()
	l := st.all
	if l == nil {
		l = st.routeLimiter(route, now)
	}
	if l == nil {
		return
	}
	if l.rps != nil {
		b := float64(l.rps.Burst())
		tok := max(0, l.rps.TokensAt(now))
		requests = Quota{Set: true, Limit: int64(b), Remaining: int64(tok),
			Reset: time.Duration((b - min(b, tok)) / float64(l.rps.Limit()) * float64(time.Second))}
	}
	if l.tpm != nil {
		tokens = Quota{Set: true, Limit: int64(l.tpm.capacity), Remaining: max(0, int64(l.tpm.level)), Reset: l.tpm.untilFull(now)}
	}
	return
}

// Stats returns the requests in flight and queued of a tenant (0 when its
// state is not held).
func (a *Admitter) Stats(tenant string) (inflight, queued int64) {
	a.mu.Lock()
	st := a.states[tenant]
	a.mu.Unlock()
	if st == nil {
		return 0, 0
	}
	return st.inflight.Load(), st.queued.Load()
}

// Tracked returns the number of tenants whose state is held.
func (a *Admitter) Tracked() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.states)
}

func (a *Admitter) evictLoop() {
	defer close(a.done)
	tick := time.NewTicker(max(a.cfg.IdleTTL/2, 100*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-tick.C:
			a.Evict()
		}
	}
}

// Evict drops the state of tenants idle for IdleTTL whose limiters have
// refilled: a fresh state then gives exactly what the old one would have,
// so eviction never hands an over-limit tenant an early burst. It runs
// periodically; tests call it directly.
func (a *Admitter) Evict() int {
	now := a.now()
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for name, st := range a.states {
		st.mu.Lock()
		if len(st.queue) == 0 && st.inflight.Load() == 0 && st.deciding == 0 && !st.pumping &&
			now.Sub(st.lastUse) >= a.cfg.IdleTTL && st.all.fresh(now) && routesFresh(st, now) {
			st.dead = true
			delete(a.states, name)
			n++
		}
		st.mu.Unlock()
	}
	return n
}

func routesFresh(st *tenantState, now time.Time) bool {
	for _, l := range st.routes {
		if !l.fresh(now) {
			return false
		}
	}
	return true
}

// StoreStats is what a shared store's client has seen.
type StoreStats struct {
	Up                bool
	Calls, Failures   int64
	Seconds           float64 // spent in store calls
	Replicas          int64   // live replicas in the heartbeats
	LeasesHeld        int
	ReleasesPending   int   // releases not yet confirmed by the store
	ReleasesRetried   int64 // releases that could not be sent at once, kept to be sent again
	ReleasesDropped   int64 // releases never sent: still unsent after releaseRetryFor (the store down that long)
	FailOpen, Present bool
}

// StoreStats returns the shared store's figures (Present false: none).
func (a *Admitter) StoreStats() StoreStats {
	s := a.shared
	if s == nil {
		return StoreStats{}
	}
	s.mu.Lock()
	n, pending := len(s.leases), 0
	for _, r := range s.releasing {
		pending += r.n
	}
	s.mu.Unlock()
	return StoreStats{Present: true, Up: s.up.Load(), Calls: s.calls.Load(), Failures: s.failures.Load(),
		Seconds: time.Duration(s.nanos.Load()).Seconds(), Replicas: s.replicas.Load(), LeasesHeld: n,
		ReleasesPending: pending, ReleasesRetried: s.retried.Load(), ReleasesDropped: s.dropped.Load(), FailOpen: s.cfg.Fail == FailOpen}
}

// OnStoreChange has f called, once per transition, when the shared store
// stops answering (with the error that opened the breaker) or answers
// again (err nil). A store already down when f is set calls it at once.
func (a *Admitter) OnStoreChange(f func(up bool, err error)) {
	if a.shared != nil {
		a.shared.onChange.Store(&f)
		if !a.shared.up.Load() {
			f(false, errDown)
		}
	}
}

// StoreAddr is the shared store's address ("" without one), for logs.
func (a *Admitter) StoreAddr() string {
	if a.shared == nil {
		return ""
	}
	return a.shared.cfg.Redis.Addr
}
