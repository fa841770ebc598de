package ratelimit

import (
	"context"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
)

// Reason says why a request was refused.
type Reason string

// The reasons of a Refusal.
const (
	ReasonRequests    Reason = "requests"    // request rate
	ReasonTokens      Reason = "tokens"      // token budget
	ReasonConcurrency Reason = "concurrency" // requests in flight
	ReasonQueueFull   Reason = "queue_full"  // the tenant's queue is full
	ReasonTimeout     Reason = "timeout"     // waited max_wait in the queue
	ReasonCancelled   Reason = "cancelled"   // the client left while queued
	ReasonRequestsDay Reason = "requests_per_day"
	ReasonTokensDay   Reason = "tokens_per_day"
	ReasonUSDDay      Reason = "usd_per_day"   // dollar budget of the UTC day
	ReasonUSDMonth    Reason = "usd_per_month" // dollar budget of the UTC month
)

// Reasons lists every Reason, for building metrics.
var Reasons = []Reason{ReasonRequests, ReasonTokens, ReasonConcurrency, ReasonQueueFull, ReasonTimeout, ReasonCancelled,
	ReasonRequestsDay, ReasonTokensDay, ReasonUSDDay, ReasonUSDMonth, ReasonStore}

// Refusal is a request that was not admitted.
type Refusal struct {
	Reason Reason
	// RetryAfter is when a retry can succeed, from the limiter state (at
	// least one second when that cannot be known, as for concurrency).
	RetryAfter time.Duration
	// Queued is the time spent in the queue before the refusal.
	Queued time.Duration
}

// Admitter decides admission for every tenant of one configuration. It is
// safe for concurrent use. Close stops its background eviction.
type Admitter struct {
	cfg     Config
	now     func() time.Time
	keys    keyIndex
	tenants map[string]*Tenant

	mu     sync.Mutex
	states map[string]*tenantState
	stop   chan struct{}
	done   chan struct{}

	// shared is the store the counts live in (nil: this process).
	shared *store
}

// tenantState is the live limiter state of one tenant: created on first use,
// dropped after IdleTTL once it is back to what a fresh state would be.
type tenantState struct {
	mu     sync.Mutex
	t      *Tenant
	all    *limiter            // the tenant's own limits, nil if none
	routes map[string]*limiter // per-route limits, created on first use
	// fallback holds the limiters at this replica's share of the limits,
	// used while a shared store is down (FailOpen); "" is the tenant's own.
	fallback map[string]*limiter
	queue    []*waiter
	timer    *time.Timer
	lastUse  time.Time
	dead     bool // evicted: callers must fetch the state again
	// deciding counts the decisions waiting on the shared store with the
	// lock let go; pumping says one goroutine admits the queue's head
	// (against a shared store), repump that a release came meanwhile.
	deciding        int
	pumping, repump bool

	inflight atomic.Int64 // for gauges
	queued   atomic.Int64

	// a is the Admitter the state belongs to now (a reload hands it on):
	// its mode pumps the queue. holds are the admissions in flight, each
	// holding a concurrency slot where it says (here, in a store, in the
	// fallback), so that a reload can hand them over (handOver).
	a     *Admitter
	holds map[*admission]struct{}
}

// reconfigure puts the tenant's new limits in place, keeping what is in
// flight and what was used. st.mu must be held.
func (st *tenantState) reconfigure(t *Tenant, now time.Time) {
	st.t = t
	switch {
	case !t.Limits.any():
		st.all = nil
	case st.all == nil:
		// The requests in flight are counted in it by recount.
		st.all = newLimiter(t.Limits, now)
	default:
		st.all.reconfigure(t.Limits, now)
	}
	for route, rl := range st.routes {
		l, ok := t.Routes[route]
		if !ok || !l.any() {
			// Tickets holding it release into it harmlessly.
			delete(st.routes, route)
			continue
		}
		rl.reconfigure(l, now)
	}
}

type waiter struct {
	route     *limiter
	routeName string
	est       usage
	ch        chan struct{}
	admitted  bool
	gone      bool // left the queue (timed out or cancelled) unadmitted
	adm       *admission
}

// admission is how a request was admitted, and where its concurrency slot
// is held while it runs: by this replica's limiters, by a lease in a
// shared store, or by this replica's fallback limiters. A reload that
// adds or takes away the store moves it (handOver); its tenant's lock
// guards it.
type admission struct {
	lease     string
	store     *store // the store the lease is in (a reload may hand it to the next Admitter)
	fallback  bool
	route     *limiter // the route limiter it counts in, here or in the fallback (nil: none)
	routeName string
	// moved: a reload handed it over from where it was admitted; its
	// release frees its slot only, the tokens it reserved being counted
	// where they were taken.
	moved bool
}

// Ticket is an admitted request. Release it exactly once, when the
// response has ended (for a stream: after its last byte), with the tokens
// it really used.
type Ticket struct {
	a         *Admitter
	st        *tenantState
	routeName string
	adm       *admission
	reserved  usage
	// Queued is the time the request waited for admission.
	Queued   time.Duration
	released atomic.Bool
}

// New builds an Admitter for cfg, which must be valid. prev, the Admitter
// of the configuration being replaced (or nil), hands over the state of
// every tenant that is still configured, so a reload neither resets
// budgets nor forgets requests in flight: a tenant whose limits changed
// keeps its count of requests in flight, its request bucket's tokens and
// the tokens its budget has used, under the new limits. prev is closed.
func New(cfg Config, now func() time.Time, prev *Admitter) *Admitter {
	if now == nil {
		now = time.Now
	}
	cfg = cfg.WithDefaults()
	a := &Admitter{
		cfg: cfg, now: now, keys: newKeyIndex(cfg.Tenants),
		tenants: make(map[string]*Tenant, len(cfg.Tenants)),
		states:  map[string]*tenantState{},
		stop:    make(chan struct{}), done: make(chan struct{}),
	}
	for i := range cfg.Tenants {
		t := &a.cfg.Tenants[i]
		a.tenants[t.Name] = t
	}
	if cfg.Store != nil {
		switch {
		case prev != nil && prev.shared != nil && reflect.DeepEqual(prev.shared.cfg, *cfg.Store):
			a.shared, prev.shared = prev.shared, nil // the same store: its client and leases carry on
		case prev != nil && prev.shared != nil:
			// Another store: it takes the leases of the requests in flight
			// over, renews them and receives their releases.
			a.shared = newStore(*cfg.Store, prev.shared)
		default:
			a.shared = newStore(*cfg.Store, nil)
		}
	}
	if prev != nil {
		// The tenants' states go on, with their requests in flight handed
		// over before the store that held them (if any) is closed.
		prev.mu.Lock()
		now := a.now()
		moved := false
		for name, st := range prev.states {
			if t, ok := a.tenants[name]; ok {
				st.mu.Lock()
				if !reflect.DeepEqual(t.Limits, st.t.Limits) || !reflect.DeepEqual(t.Routes, st.t.Routes) {
					st.reconfigure(t, now)
				} else {
					st.t = t
				}
				st.a = a
				moved = st.handOver(a.shared, now) || moved
				st.mu.Unlock()
				a.states[name] = st
			}
		}
		prev.mu.Unlock()
		prev.Close()
		if moved && a.shared != nil {
			a.shared.renewNow()
		}
	}
	go a.evictLoop()
	return a
}

// Close stops the eviction loop, and the shared store's client unless a
// later configuration took it over.
func (a *Admitter) Close() {
	select {
	case <-a.stop:
	default:
		close(a.stop)
		<-a.done
		if a.shared != nil {
			a.shared.close()
		}
	}
}

// Mode returns the configured mode.
func (a *Admitter) Mode() Mode { return a.cfg.Mode }

// Config returns the configuration a was built from.
func (a *Admitter) Config() *Config { return &a.cfg }

// Identify returns the tenant owning key. It does not allocate.
func (a *Admitter) Identify(key []byte) (string, bool) { return a.keys.lookup(key) }

// Has reports a configured tenant.
func (a *Admitter) Has(tenant string) bool {
	_, ok := a.tenants[tenant]
	return ok
}

// SpendsDollars reports whether tenant has a dollar budget (usd_per_day or
// usd_per_month) of its own or on route: a request of it must be priced.
func (a *Admitter) SpendsDollars(tenant, route string) bool {
	t := a.tenants[tenant]
	if t == nil {
		return false
	}
	dollars := func(l Limits) bool { return l.USDPerDay > 0 || l.USDPerMonth > 0 }
	return dollars(t.Limits) || dollars(t.Routes[route])
}

// state returns the live state of a configured tenant, creating it.
func (a *Admitter) state(name string) *tenantState {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.states[name]
	if st == nil {
		t := a.tenants[name]
		st = &tenantState{t: t, a: a}
		if t.Limits.any() {
			st.all = newLimiter(t.Limits, a.now())
		}
		a.states[name] = st
	}
	return st
}

// lock returns the tenant's state, locked and not evicted.
func (a *Admitter) lock(name string) *tenantState {
	for {
		st := a.state(name)
		st.mu.Lock()
		if !st.dead {
			return st
		}
		st.mu.Unlock()
	}
}

// routeLimiter returns the tenant's limiter for route, or nil.
func (st *tenantState) routeLimiter(route string, now time.Time) *limiter {
	l, ok := st.t.Routes[route]
	if !ok || !l.any() {
		return nil
	}
	if st.routes == nil {
		st.routes = map[string]*limiter{}
	}
	rl := st.routes[route]
	if rl == nil {
		rl = newLimiter(l, now)
		st.routes[route] = rl
	}
	return rl
}

// check combines the tenant's and the route's limits.
func (st *tenantState) check(now time.Time, rl *limiter, est usage) (bool, time.Duration, Reason) {
	return checkPair(now, st.all, rl, est)
}

// checkPair combines a tenant's limiter and its route's (either nil).
func checkPair(now time.Time, all, rl *limiter, est usage) (bool, time.Duration, Reason) {
	ok, wait, reason := true, time.Duration(0), Reason("")
	for _, l := range [2]*limiter{all, rl} {
		if l == nil {
			continue
		}
		w, r := l.check(now, est)
		if w == 0 {
			continue
		}
		if ok || w < 0 || (wait >= 0 && w > wait) {
			wait, reason = w, r
		}
		ok = false
	}
	return ok, wait, reason
}

func (st *tenantState) take(now time.Time, rl *limiter, est usage) {
	if st.all != nil {
		st.all.take(now, est)
	}
	if rl != nil {
		rl.take(now, est)
	}
	st.inflight.Add(1)
}

// try admits a request of est tokens of st on route now if every limit
// allows it, taking them: in the shared store when there is one (or, while
// it is down and the config says open, in this replica's share of the
// limits), else here. Otherwise it reports how long until it could pass
// (-1: until a request ends) and why. st is locked; with a shared store
// the lock is let go during the store's round trip (the tenant's other
// requests decide meanwhile) and held again when try returns.
func (a *Admitter) try(st *tenantState, rl *limiter, route string, est usage, now time.Time) (*admission, bool, time.Duration, Reason) {
	if a.shared == nil || st.all == nil && rl == nil {
		// Here, or a tenant without limits: nothing to ask the store.
		ok, wait, reason := st.check(now, rl, est)
		if !ok {
			return nil, false, wait, reason
		}
		st.take(now, rl, est)
		return st.hold(&admission{route: rl, routeName: route}), true, 0, ""
	}
	var all, rlim *Limits
	if st.all != nil {
		l := st.all.lim
		all = &l
	}
	if rl != nil {
		l := rl.lim
		rlim = &l
	}
	shared, name := a.shared, st.t.Name
	st.deciding++
	st.mu.Unlock()
	lease, wait, reason, err := shared.admit(name, route, all, rlim, est)
	st.mu.Lock()
	st.deciding--
	now = a.now()
	switch {
	case err == nil && wait == 0:
		st.inflight.Add(1)
		adm := st.hold(&admission{lease: lease, store: shared, routeName: route})
		if st.a != a {
			// A reload came while the store decided: moved as the others were.
			st.handOver(st.a.shared, now)
		}
		return adm, true, 0, ""
	case err == nil:
		return nil, false, wait, reason
	case a.cfg.Store.Fail == FailClosed:
		return nil, false, time.Second, ReasonStore
	}
	// The store is down and the config says open: this replica's share.
	fa, fr := st.fallbackLimiters(route, rl != nil, shared.shareOf(), now)
	ok, wait, reason := checkPair(now, fa, fr, est)
	if !ok {
		return nil, false, wait, reason
	}
	for _, l := range [2]*limiter{fa, fr} {
		if l != nil {
			l.take(now, est)
		}
	}
	st.inflight.Add(1)
	return st.hold(&admission{fallback: true, route: fr, routeName: route}), true, 0, ""
}

// fallbackLimiters returns the tenant's limiters at share of its limits
// (and of its route's, with route), made or rescaled as the share moves.
func (st *tenantState) fallbackLimiters(route string, withRoute bool, share float64, now time.Time) (*limiter, *limiter) {
	if st.fallback == nil {
		st.fallback = map[string]*limiter{}
	}
	get := func(key string, lim Limits) *limiter {
		lim = scaled(lim, share)
		l := st.fallback[key]
		switch {
		case l == nil:
			l = newLimiter(lim, now)
			st.fallback[key] = l
		case l.lim != lim:
			l.reconfigure(lim, now)
		}
		return l
	}
	var fa, fr *limiter
	if st.t.Limits.any() {
		fa = get("", st.t.Limits)
	}
	if withRoute {
		fr = get("r:"+route, st.t.Routes[route])
	}
	return fa, fr
}

// Admit decides on one request of tenant (which must be configured) on
// route, estimated to use est tokens. In queue mode it may wait, until
// admitted, MaxWait has passed, or ctx is done (the client left).
func (a *Admitter) Admit(ctx context.Context, tenant, route string, est int64) (*Ticket, *Refusal) {
	return a.admit(ctx, tenant, route, usage{tokens: est})
}

// AdmitUSD is Admit for a request also estimated to cost usd dollars, held
// against the dollar budgets until ReleaseUSD says what it cost.
func (a *Admitter) AdmitUSD(ctx context.Context, tenant, route string, est int64, usd float64) (*Ticket, *Refusal) {
	return a.admit(ctx, tenant, route, usage{tokens: est, micro: micro(usd)})
}

func (a *Admitter) admit(ctx context.Context, tenant, route string, est usage) (*Ticket, *Refusal) {
	st := a.lock(tenant)
	now := a.now()
	st.lastUse = now
	rl := st.routeLimiter(route, now)
	if len(st.queue) == 0 {
		adm, ok, wait, reason := a.try(st, rl, route, est, now)
		if ok {
			st.mu.Unlock()
			return &Ticket{a: a, st: st, routeName: route, adm: adm, reserved: est}, nil
		}
		if a.cfg.Mode != ModeQueue || wait > a.cfg.MaxWait || reason == ReasonStore {
			st.mu.Unlock()
			return nil, &Refusal{Reason: reason, RetryAfter: retryAfter(wait)}
		}
	}
	if len(st.queue) >= a.cfg.MaxQueue {
		st.mu.Unlock()
		return nil, &Refusal{Reason: ReasonQueueFull, RetryAfter: time.Second}
	}
	w := &waiter{route: rl, routeName: route, est: est, ch: make(chan struct{})}
	st.queue = append(st.queue, w)
	st.queued.Add(1)
	a.pumpLocked(st, now)
	st.mu.Unlock()

	timer := time.NewTimer(a.cfg.MaxWait)
	defer timer.Stop()
	reason := ReasonTimeout
	select {
	case <-w.ch:
		return &Ticket{a: a, st: st, routeName: route, adm: w.adm, reserved: est, Queued: a.now().Sub(now)}, nil
	case <-ctx.Done():
		reason = ReasonCancelled
	case <-timer.C:
	}
	st.mu.Lock()
	if w.admitted {
		// Admitted in the same instant: a timed-out request uses its slot;
		// a cancelled one gives back exactly what it was given.
		st.mu.Unlock()
		t := &Ticket{a: a, st: st, routeName: route, adm: w.adm, reserved: est, Queued: a.now().Sub(now)}
		if reason == ReasonTimeout {
			return t, nil
		}
		t.release(usage{})
		return nil, &Refusal{Reason: reason, RetryAfter: time.Second, Queued: t.Queued}
	}
	for i, q := range st.queue {
		if q == w {
			st.queue = append(st.queue[:i], st.queue[i+1:]...)
			st.queued.Add(-1)
			break
		}
	}
	w.gone = true
	a.pumpLocked(st, a.now()) // the head may have changed
	wait := time.Second
	if a.shared == nil {
		if ok, w2, _ := st.check(a.now(), rl, est); !ok {
			wait = retryAfter(w2)
		}
	}
	st.mu.Unlock()
	return nil, &Refusal{Reason: reason, RetryAfter: wait, Queued: a.now().Sub(now)}
}

// Release ends an admitted request: its concurrency slot is freed and its
// token reservation replaced by actual, the tokens it really used (input
// and output; 0 when nothing reached the model). It may be called more than
// once and on a nil Ticket; only the first call counts.
func (t *Ticket) Release(actual int64) {
	if t == nil {
		return
	}
	t.release(usage{tokens: actual, micro: t.reserved.micro})
}

// ReleaseUSD is Release with what the request cost, in dollars, for the
// dollar budgets.
func (t *Ticket) ReleaseUSD(actual int64, usd float64) {
	if t == nil {
		return
	}
	t.release(usage{tokens: actual, micro: micro(usd)})
}

func (t *Ticket) release(actual usage) {
	if !t.released.CompareAndSwap(false, true) {
		return
	}
	st := t.st
	st.mu.Lock()
	adm, reserved := t.adm, t.reserved
	delete(st.holds, adm)
	if adm.moved {
		reserved, actual = usage{}, usage{}
	}
	now := t.a.now()
	switch {
	case adm.lease != "":
		all, rl := st.limitsOn(t.routeName)
		adm.store.release(st.t.Name, t.routeName, all, rl, adm.lease, reserved, actual)
	case adm.fallback:
		if l := st.fallback[""]; l != nil {
			l.release(now, reserved, actual)
		}
		if adm.route != nil {
			adm.route.release(now, reserved, actual)
		}
	default:
		if st.all != nil {
			st.all.release(now, reserved, actual)
		}
		if adm.route != nil {
			adm.route.release(now, reserved, actual)
		}
	}
	st.inflight.Add(-1)
	st.lastUse = now
	st.a.pumpLocked(st, now)
	st.mu.Unlock()
}
