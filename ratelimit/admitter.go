package ratelimit

import (
	"context"
	"math"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
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

// usage is what a request is reserved, or used: tokens (input and output)
// and micro-dollars.
type usage struct{ tokens, micro int64 }

// micro is dollars in whole micro-dollars, rounded up (a reservation is
// never short by the rounding).
func micro(usd float64) int64 {
	if usd <= 0 || math.IsNaN(usd) {
		return 0
	}
	return int64(math.Ceil(usd * 1e6))
}

// monthOf is the UTC calendar month of now (months since year 0) and
// how long until the next begins.
func monthOf(now time.Time) (int64, time.Duration) {
	u := now.UTC()
	next := time.Date(u.Year(), u.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	return int64(u.Year())*12 + int64(u.Month()-1), next.Sub(now)
}

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
}

// reconfigure puts the tenant's new limits in place, keeping what is in
// flight and what was used. st.mu must be held.
func (st *tenantState) reconfigure(t *Tenant, now time.Time) {
	st.t = t
	switch {
	case !t.Limits.any():
		st.all = nil
	case st.all == nil:
		st.all = newLimiter(t.Limits, now)
		// Every request in flight counts against the new limits; their
		// releases decrement it (Release checks st.all).
		st.all.inflight = int(st.inflight.Load())
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

// reconfigure changes a limiter's limits in place: requests in flight stay
// counted, the request bucket keeps its tokens (capped at the new burst)
// and the token budget keeps what was used of it.
func (l *limiter) reconfigure(lim Limits, now time.Time) {
	fresh := newLimiter(lim, now)
	if l.rps != nil && fresh.rps != nil {
		tokens := min(l.rps.TokensAt(now), float64(fresh.rps.Burst()))
		// Bring the new bucket to the old level.
		if spend := int(float64(fresh.rps.Burst()) - tokens); spend > 0 {
			fresh.rps.AllowN(now, spend)
		}
	}
	if l.tpm != nil && fresh.tpm != nil {
		l.tpm.refill(now)
		used := l.tpm.capacity - l.tpm.level
		fresh.tpm.level = fresh.tpm.capacity - used
	}
	l.lim, l.rps, l.tpm = lim, fresh.rps, fresh.tpm
}

// limiter is one set of limits with its state.
type limiter struct {
	lim      Limits
	rps      *rate.Limiter
	tpm      *budget
	day      int64 // the UTC day rpd, tpd and usdDay count
	rpd, tpd int64
	// The dollar budgets' use, in micro-dollars: of the day, and of the
	// UTC month mon.
	usdDay, usdMon int64
	mon            int64
	inflight       int
}

type waiter struct {
	route     *limiter
	routeName string
	est       usage
	ch        chan struct{}
	admitted  bool
	gone      bool // left the queue (timed out or cancelled) unadmitted
	adm       admission
}

// admission is how a request was admitted: its lease in a shared store,
// or by this replica's fallback limiters.
type admission struct {
	lease    string
	store    *store // the store the lease is in (a reload may hand it to the next Admitter)
	fallback bool
	route    *limiter // the local route limiter it took from (nil: none)
}

// Ticket is an admitted request. Release it exactly once, when the
// response has ended (for a stream: after its last byte), with the tokens
// it really used.
type Ticket struct {
	a         *Admitter
	st        *tenantState
	routeName string
	adm       admission
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
		prev.Close()
		prev.mu.Lock()
		now := a.now()
		for name, st := range prev.states {
			if t, ok := a.tenants[name]; ok {
				st.mu.Lock()
				if !reflect.DeepEqual(t.Limits, st.t.Limits) || !reflect.DeepEqual(t.Routes, st.t.Routes) {
					st.reconfigure(t, now)
				} else {
					st.t = t
				}
				st.mu.Unlock()
				a.states[name] = st
			}
		}
		prev.mu.Unlock()
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

// state returns the live state of a configured tenant, creating it.
func (a *Admitter) state(name string) *tenantState {
	a.mu.Lock()
	defer a.mu.Unlock()
	st := a.states[name]
	if st == nil {
		t := a.tenants[name]
		st = &tenantState{t: t}
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

func newLimiter(l Limits, now time.Time) *limiter {
	lm := &limiter{lim: l}
	if l.RequestsPerSecond > 0 {
		burst := l.Burst
		if burst == 0 {
			burst = max(1, int(math.Ceil(l.RequestsPerSecond)))
		}
		lm.rps = rate.NewLimiter(rate.Limit(l.RequestsPerSecond), burst)
	}
	if l.TokensPerMinute > 0 {
		lm.tpm = newBudget(l.TokensPerMinute, now)
	}
	return lm
}

// check reports whether an estimate est can be admitted now; if not, how
// long until it can (-1: unknown, waiting on a release).
func (l *limiter) check(now time.Time, est usage) (time.Duration, Reason) {
	if l.lim.MaxConcurrent > 0 && l.inflight >= l.lim.MaxConcurrent {
		return -1, ReasonConcurrency
	}
	var wait time.Duration
	var reason Reason
	if l.rps != nil {
		if tok := l.rps.TokensAt(now); tok < 1 {
			wait = time.Duration((1 - tok) / float64(l.rps.Limit()) * float64(time.Second))
			wait, reason = max(wait, time.Nanosecond), ReasonRequests
		}
	}
	if l.tpm != nil {
		if w := l.tpm.wait(now, est.tokens); w > wait {
			wait, reason = w, ReasonTokens
		}
	}
	if l.lim.RequestsPerDay > 0 || l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		untilDay := time.Unix((l.day+1)*86400, 0).Sub(now)
		if l.lim.RequestsPerDay > 0 && l.rpd >= l.lim.RequestsPerDay && untilDay > wait {
			wait, reason = untilDay, ReasonRequestsDay
		}
		if l.lim.TokensPerDay > 0 && l.tpd+min(est.tokens, l.lim.TokensPerDay) > l.lim.TokensPerDay && untilDay > wait {
			wait, reason = untilDay, ReasonTokensDay
		}
		if b := micro(l.lim.USDPerDay); b > 0 && l.usdDay+min(est.micro, b) > b && untilDay > wait {
			wait, reason = untilDay, ReasonUSDDay
		}
	}
	if b := micro(l.lim.USDPerMonth); b > 0 {
		untilMonth := l.rollMonth(now)
		if l.usdMon+min(est.micro, b) > b && untilMonth > wait {
			wait, reason = untilMonth, ReasonUSDMonth
		}
	}
	return wait, reason
}

// rollDay starts the day's counts afresh when a new UTC day began.
func (l *limiter) rollDay(now time.Time) {
	if d := now.Unix() / 86400; d != l.day {
		l.day, l.rpd, l.tpd, l.usdDay = d, 0, 0, 0
	}
}

// rollMonth starts the month's count afresh when a new UTC month began,
// and returns how long until the next.
func (l *limiter) rollMonth(now time.Time) time.Duration {
	m, until := monthOf(now)
	if m != l.mon {
		l.mon, l.usdMon = m, 0
	}
	return until
}

func (l *limiter) take(now time.Time, est usage) {
	l.inflight++
	if l.rps != nil {
		l.rps.AllowN(now, 1)
	}
	if l.tpm != nil {
		l.tpm.take(now, est.tokens)
	}
	if l.lim.RequestsPerDay > 0 || l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		l.rpd++
		l.tpd += est.tokens
		l.usdDay += est.micro
	}
	if l.lim.USDPerMonth > 0 {
		l.rollMonth(now)
		l.usdMon += est.micro
	}
}

func (l *limiter) release(now time.Time, reserved, actual usage) {
	l.inflight--
	if l.tpm != nil {
		l.tpm.reconcile(now, reserved.tokens, actual.tokens)
	}
	if l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		l.tpd = max(0, l.tpd+actual.tokens-reserved.tokens)
		l.usdDay = max(0, l.usdDay+actual.micro-reserved.micro)
	}
	if l.lim.USDPerMonth > 0 {
		l.rollMonth(now)
		l.usdMon = max(0, l.usdMon+actual.micro-reserved.micro)
	}
}

// fresh reports that the limiter is as a new one would be: nothing in
// flight and every bucket full.
func (l *limiter) fresh(now time.Time) bool {
	if l == nil {
		return true
	}
	if l.inflight > 0 {
		return false
	}
	if l.rollDay(now); l.rpd > 0 || l.tpd > 0 || l.usdDay > 0 {
		return false // the day's budgets would start again
	}
	if l.rollMonth(now); l.usdMon > 0 {
		return false
	}
	if l.rps != nil && l.rps.TokensAt(now) < float64(l.rps.Burst()) {
		return false
	}
	return l.tpm == nil || l.tpm.untilFull(now) <= 0
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
func (a *Admitter) try(st *tenantState, rl *limiter, route string, est usage, now time.Time) (admission, bool, time.Duration, Reason) {
	if a.shared == nil {
		ok, wait, reason := st.check(now, rl, est)
		if ok {
			st.take(now, rl, est)
		}
		return admission{route: rl}, ok, wait, reason
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
		return admission{lease: lease, store: shared, route: rl}, true, 0, ""
	case err == nil:
		return admission{}, false, wait, reason
	case a.cfg.Store.Fail == FailClosed:
		return admission{}, false, time.Second, ReasonStore
	}
	// The store is down and the config says open: this replica's share.
	fa, fr := st.fallbackLimiters(route, rl != nil, shared.shareOf(), now)
	ok, wait, reason := checkPair(now, fa, fr, est)
	if !ok {
		return admission{}, false, wait, reason
	}
	for _, l := range [2]*limiter{fa, fr} {
		if l != nil {
			l.take(now, est)
		}
	}
	st.inflight.Add(1)
	return admission{fallback: true, route: fr}, true, 0, ""
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

// scaled is l at share of each limit (a burst or a concurrency at least 1).
func scaled(l Limits, share float64) Limits {
	f := func(v int64) int64 {
		if v == 0 {
			return 0
		}
		return max(1, int64(math.Ceil(float64(v)*share)))
	}
	out := Limits{RequestsPerSecond: l.RequestsPerSecond * share, TokensPerMinute: f(l.TokensPerMinute),
		MaxConcurrent: int(f(int64(l.MaxConcurrent))), RequestsPerDay: f(l.RequestsPerDay), TokensPerDay: f(l.TokensPerDay),
		USDPerDay: l.USDPerDay * share, USDPerMonth: l.USDPerMonth * share}
	if l.RequestsPerSecond > 0 {
		b := l.Burst
		if b == 0 {
			b = max(1, int(math.Ceil(l.RequestsPerSecond)))
		}
		out.Burst = int(f(int64(b)))
	}
	return out
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

func retryAfter(wait time.Duration) time.Duration {
	if wait <= 0 {
		return time.Second
	}
	return wait
}

// sharedPoll is how often a queue waiting on a shared store's concurrency
// looks again: the releases of other replicas do not reach this one.
const sharedPoll = 25 * time.Millisecond

// pumpLocked admits queued requests in order while the limits allow, and
// otherwise arranges to try again when the head could pass. st is locked.
// Against a shared store the queue is admitted by one goroutine of its own
// (pumpShared), so that no caller waits on the store's round trips.
func (a *Admitter) pumpLocked(st *tenantState, now time.Time) {
	if a.shared != nil {
		switch {
		case len(st.queue) == 0:
		case st.pumping:
			st.repump = true
		default:
			st.pumping = true
			go a.pumpShared(st)
		}
		return
	}
	for len(st.queue) > 0 {
		w := st.queue[0]
		adm, ok, wait, _ := a.try(st, w.route, w.routeName, w.est, now)
		if !ok {
			if wait <= 0 && a.shared != nil {
				wait = sharedPoll
			}
			if wait > 0 {
				if st.timer != nil {
					st.timer.Stop()
				}
				a.pumpAfter(st, wait)
			}
			return // waiting on a release otherwise
		}
		st.admitHead(w, adm)
	}
}

// pumpAfter has the queue pumped again after wait. st is locked.
func (a *Admitter) pumpAfter(st *tenantState, wait time.Duration) {
	if st.timer != nil {
		st.timer.Stop()
	}
	st.timer = time.AfterFunc(wait, func() {
		st.mu.Lock()
		a.pumpLocked(st, a.now())
		st.mu.Unlock()
	})
}

// admitHead takes the queue's head, w, out of it as admitted. st is locked.
func (st *tenantState) admitHead(w *waiter, adm admission) {
	st.queue[0] = nil
	st.queue = st.queue[1:]
	st.queued.Add(-1)
	w.admitted, w.adm = true, adm
	close(w.ch)
}

// pumpShared admits the queue's head against the shared store, one
// decision at a time, until the queue is empty or its head must wait; it
// is the only goroutine pumping st's queue while st.pumping is set.
func (a *Admitter) pumpShared(st *tenantState) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for len(st.queue) > 0 {
		w := st.queue[0]
		st.repump = false
		adm, ok, wait, _ := a.try(st, w.route, w.routeName, w.est, a.now())
		if w.gone {
			// It left while the store decided: what it was given goes back.
			if ok {
				t := &Ticket{a: a, st: st, routeName: w.routeName, adm: adm, reserved: w.est}
				st.mu.Unlock()
				t.release(usage{})
				st.mu.Lock()
			}
			continue
		}
		if ok {
			st.admitHead(w, adm)
			continue
		}
		if st.repump {
			continue // a release came while the store decided: at once again
		}
		if wait <= 0 {
			wait = sharedPoll
		}
		a.pumpAfter(st, wait)
		break
	}
	st.pumping = false
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
	if t.adm.lease != "" {
		var all, rlim *Limits
		if l := st.t.Limits; l.any() {
			all = &l
		}
		if l, ok := st.t.Routes[t.routeName]; ok && l.any() {
			rlim = &l
		}
		t.adm.store.release(st.t.Name, t.routeName, all, rlim, t.adm.lease, t.reserved, actual)
	}
	st.mu.Lock()
	now := t.a.now()
	switch {
	case t.adm.lease != "":
	case t.adm.fallback:
		if l := st.fallback[""]; l != nil {
			l.release(now, t.reserved, actual)
		}
		if t.adm.route != nil {
			t.adm.route.release(now, t.reserved, actual)
		}
	default:
		if st.all != nil {
			st.all.release(now, t.reserved, actual)
		}
		if t.adm.route != nil {
			t.adm.route.release(now, t.reserved, actual)
		}
	}
	st.inflight.Add(-1)
	st.lastUse = now
	t.a.pumpLocked(st, now)
	st.mu.Unlock()
}

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
