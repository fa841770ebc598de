package ratelimit

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A shared store: every replica that names the same Redis (or Valkey) and
// key prefix decides against the same counts. Each decision is one
// server-side script that checks every limit of the tenant (and of the
// tenant on the route) and, only when all pass, takes them, atomically:
// replicas never decide on a local copy that is written back later. The
// clock is the store's (TIME), so replicas' clocks do not matter.
//
//   - requests per second with a burst: a token bucket (level and time);
//   - tokens per minute: a budget whose reservation is taken before
//     forwarding and reconciled with the real usage after (Release), so a
//     cancelled stream gives back what it did not use;
//   - max_concurrent: a lease per request in a sorted set scored by its
//     expiry; a replica renews its leases while their streams run, so a
//     replica that dies holds a slot for at most the lease time;
//   - requests and tokens per UTC day: counters keyed by the day.
//
// Every key expires on its own once it would read as fresh. The fair
// queue stays in each replica and admits against the shared counts.

// ReasonStore: the shared store did not answer (fail closed).
const ReasonStore Reason = "store_unavailable"

// The breaker: after tripAfter calls in a row failed, the store is taken as
// down and no decision waits for it (fail decides at once) until a probe,
// every probeEvery, is answered.
const (
	tripAfter  = 3
	probeEvery = 100 * time.Millisecond
	// poolSize bounds the connections to the store: decisions of one tenant
	// run side by side, each one round trip.
	poolSize = 64
	// maxReleasing bounds the leases of one tenant whose release is on its
	// way that a decision sends along (the concurrency check leaves them
	// out); past it a decision may count a slot that is being freed.
	maxReleasing = 64
)

// callGrace is what a call's context allows past its timeout: the time
// this replica took to get to the call is not the store's.
const callGrace = 5 * time.Second

// errDown is the answer of a store whose breaker is open.
var errDown = errors.New("the admission store is down (the breaker is open until a probe is answered)")

// store is the shared store's client, shared by the Admitters of
// successive configurations that name the same store. A decision is one
// call on the caller's goroutine, with no lock held; releases, heartbeats
// and lease renewals are sent by the store's own goroutine (loop), in
// order, so a renewal can never bring back a lease whose release it sent
// before.
type store struct {
	c        *redis.Client
	cfg      StoreConfig
	id       string // this replica
	up       atomic.Bool
	streak   atomic.Int32 // calls failed in a row
	replicas atomic.Int64 // live replicas seen in the heartbeats, at least 1
	seq      atomic.Uint64

	mu        sync.Mutex
	leases    map[string]leaseHold  // the leases of requests in flight
	releases  []releaseOp           // releases not yet sent
	releasing map[string]*releasing // tenant → its releases sent or not, and not yet confirmed
	next      *store                // the store of a later configuration that took the leases over

	calls, failures, nanos, dropped atomic.Int64
	retried                         atomic.Int64 // releases kept to be sent again
	onChange                        atomic.Pointer[func(up bool, err error)]

	kick chan struct{}
	stop chan struct{}
	done chan struct{}
}

// leaseHold is where a lease holds a concurrency slot: the tenant's own
// (all) and the tenant's on route.
type leaseHold struct {
	tenant, route string
	all, onRoute  bool
}

// releasing is what a tenant's releases on their way give back: the
// leases they free and the tokens they return (reserved minus used), to
// the tenant's own limits and to its limits on each route. A decision
// counts them as given back already, so that a client's next request on a
// kept-alive connection is decided as if its last one's release had landed.
type releasing struct {
	pending     []pendingRelease // at most maxReleasing, sent along with a decision
	credit      int64            // every one's tokens, the pending's included
	routeCredit map[string]int64
	n           int
}

// pendingRelease is one release on its way, as a decision sends it: its
// lease, and the tokens it gives back to the tenant and to its route. The
// decision's script counts them only while the release has not landed (its
// script marks the lease as landed): between a release landing and its
// confirmation here, a decision would otherwise count its tokens twice, and
// a bucket given back twice over looked full to a request larger than it.
type pendingRelease struct {
	lease    string
	back     int64
	route    string
	hasRoute bool
}

// quiet drops the Redis client's own log lines (its dial failures, with
// addresses): the store's transitions are logged once each by tokentap
// (Admitter.OnStoreChange) and its failures counted.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

var quietOnce sync.Once

// newStore connects to the store of cfg and warms the connection (the
// scripts loaded, connections dialled) before it decides anything; a store
// that does not answer then starts with its breaker open. prev, the store
// of the configuration being replaced (or nil), hands over its leases:
// the new store renews them (in its own keys) and the requests holding
// them release there.
func newStore(cfg StoreConfig, prev *store) *store {
	quietOnce.Do(func() { redis.SetLogger(quiet{}) })
	o := &redis.Options{Addr: cfg.Redis.Addr, Username: cfg.Redis.Username, Password: cfg.Redis.Password, DB: cfg.Redis.DB,
		DialTimeout: 4 * cfg.Redis.Timeout, ReadTimeout: cfg.Redis.Timeout, WriteTimeout: cfg.Redis.Timeout,
		MaxRetries: -1, PoolTimeout: cfg.Redis.Timeout, ContextTimeoutEnabled: true,
		PoolSize: poolSize, MinIdleConns: 2}
	if cfg.Redis.TLS {
		o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}

	var b [8]byte
	_, _ = rand.Read(b[:])
	s := &store{c: redis.NewClient(o), cfg: cfg, id: hex.EncodeToString(b[:]), leases: map[string]leaseHold{},
		releasing: map[string]*releasing{}, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	s.up.Store(true)
	s.replicas.Store(1)
	if prev != nil {
		s.adopt(prev)
	}
	if err := s.warm(); err != nil {
		s.streak.Store(tripAfter)
		s.up.Store(false)
	}
	go s.loop()
	return s
}

// warm loads the scripts and makes the first round trips, so that the
// first decision is not the one that pays for them.
func (s *store) warm() error {
	ctx, cancel := context.WithTimeout(context.Background(), 4*s.cfg.Redis.Timeout+s.cfg.Redis.Timeout)
	defer cancel()
	for _, sc := range []*redis.Script{admitScript, releaseScript, renewScript, heartbeatScript} {
		if err := sc.Load(ctx, s.c).Err(); err != nil {
			return err
		}
	}
	return nil
}

// adopt takes over prev's leases and the releases it has not sent, and
// makes prev hand later releases to s. A lease's release reconciles no
// tokens in another Redis or under another key prefix than the one it was
// taken in: only its slot is freed there.
func (s *store) adopt(prev *store) {
	prev.mu.Lock()
	defer prev.mu.Unlock()
	same := sameTarget(prev.cfg, s.cfg)
	for l, h := range prev.leases {
		s.leases[l] = h
	}
	for _, op := range prev.releases {
		if !same {
			op.reserved, op.actual = usage{}, usage{}
		}
		s.releases = append(s.releases, op)
	}
	prev.releases = nil
	prev.next = s
}

// sameTarget reports that two store configurations keep their counts in
// the same keys.
func sameTarget(a, b StoreConfig) bool {
	return a.Redis.Addr == b.Redis.Addr && a.Redis.DB == b.Redis.DB && a.Redis.KeyPrefix == b.Redis.KeyPrefix
}

func (s *store) close() {
	close(s.stop)
	<-s.done
	_ = s.c.Close()
}

// call runs f within the store's timeout, counting it and following up
// and down: tripAfter failures in a row open the breaker, an answer
// closes it.
func (s *store) call(timeout time.Duration, f func(ctx context.Context) error) error {
	// The store answers within timeout of being asked: the client sets
	// each read's and write's deadline (ReadTimeout, WriteTimeout) as it
	// sends. The context's deadline, later by callGrace, bounds the rest:
	// on a busy machine the goroutine may wait for a processor before it
	// asks, and that is not the store's delay. With the context at
	// timeout, 3 replicas of 16 clients each beside 8 goroutines spinning
	// failed 59-135 of ~2,800 calls (the breaker tripped, 118k-577k 503s
	// in 5 s); with the grace, none.
	ctx, cancel := context.WithTimeout(context.Background(), timeout+callGrace)
	defer cancel()
	start := time.Now()
	err := f(ctx)
	s.calls.Add(1)
	s.nanos.Add(int64(time.Since(start)))
	if err != nil && !errors.Is(err, redis.Nil) {
		s.failures.Add(1)
		if s.streak.Add(1) >= tripAfter && s.up.Swap(false) {
			s.notify(false, err)
		}
		return err
	}
	s.streak.Store(0)
	if !s.up.Swap(true) {
		s.notify(true, nil)
	}
	return nil
}

func (s *store) notify(up bool, err error) {
	if f := s.onChange.Load(); f != nil {
		(*f)(up, err)
	}
}

// background is the timeout of the calls the store's goroutine makes:
// they hold no request, and a batch of releases takes longer than one.
func (s *store) background() time.Duration { return max(s.cfg.Redis.Timeout, 250*time.Millisecond) }

// loop sends the releases as they come, beats this replica's heartbeat,
// counts the live replicas and renews the leases of the requests in
// flight every LeaseTTL/3 (at most 1 s); while the breaker is open it
// probes the store every probeEvery instead.
func (s *store) loop() {
	defer close(s.done)
	every := max(min(s.cfg.LeaseTTL/3, time.Second), probeEvery) // the config's floor keeps it above; a tick is never 0
	beat := time.NewTicker(every)
	defer beat.Stop()
	probe := time.NewTicker(probeEvery)
	defer probe.Stop()
	if s.up.Load() {
		s.beat(every)
	}
	for {
		select {
		case <-s.stop:
			s.flush()
			if s.up.Load() {
				_ = s.call(s.background(), func(ctx context.Context) error {
					return s.c.ZRem(ctx, s.cfg.Redis.KeyPrefix+"replicas", s.id).Err()
				})
			}
			return
		case <-s.kick:
			s.flush()
		case <-beat.C:
			if s.up.Load() {
				s.flush()
				s.beat(every)
			}
		case <-probe.C:
			if !s.up.Load() {
				s.beat(every) // the heartbeat is the probe; answered, it restores the leases
			}
		}
	}
}

func (s *store) beat(every time.Duration) {
	key := s.cfg.Redis.KeyPrefix + "replicas"
	var live int64
	if err := s.call(s.background(), func(ctx context.Context) error {
		v, err := heartbeatScript.Run(ctx, s.c, []string{key}, s.id, (3 * every).Seconds()).Int64()
		live = v
		return err
	}); err != nil {
		return
	}
	if live > 0 {
		s.replicas.Store(live)
	}
	s.renew()
}

// renewNow renews every lease this replica holds at once: those a reload
// just handed over are counted in the store before the next decision.
func (s *store) renewNow() {
	if s.up.Load() {
		s.renew()
	}
}

// hold registers a lease for a request of tenant t on route admitted
// elsewhere (a reload handed it over): renewed with the others, released
// as they are.
func (s *store) hold(t *Tenant, route string) string {
	lease := s.id + ":" + strconv.FormatUint(s.seq.Add(1), 36)
	h := leaseHold{tenant: t.Name, route: route, all: t.Limits.MaxConcurrent > 0, onRoute: t.Routes[route].MaxConcurrent > 0}
	if h.all || h.onRoute {
		s.mu.Lock()
		s.leases[lease] = h
		s.mu.Unlock()
	}
	return lease
}

// renew renews every lease this replica holds, in calls of up to
// renewBatch: the key of each holding, and its lease beside it. A lease
// the store lost (a restart without persistence, a stall past its time)
// is put back.
func (s *store) renew() {
	var keys []string
	args := []any{s.cfg.LeaseTTL.Seconds()}
	s.mu.Lock()
	for l, h := range s.leases {
		if h.all {
			keys, args = append(keys, s.base(h.tenant, "", false)+":conc"), append(args, l)
		}
		if h.onRoute {
			keys, args = append(keys, s.base(h.tenant, h.route, true)+":conc"), append(args, l)
		}
	}
	s.mu.Unlock()
	for len(keys) > 0 {
		n := min(len(keys), renewBatch)
		k, a := keys[:n], append([]any{args[0]}, args[1:1+n]...)
		keys, args = keys[n:], append(args[:1], args[1+n:]...)
		if s.call(s.background(), func(ctx context.Context) error { return renewScript.Run(ctx, s.c, k, a...).Err() }) != nil {
			return
		}
	}
}

// renewBatch bounds the leases one renewal call carries; releaseBatch the
// releases one pipeline carries.
const (
	renewBatch   = 512
	releaseBatch = 256
)

// shareOf is this replica's share of a limit while it falls back to its
// own limiter.
func (s *store) shareOf() float64 {
	return max(1/float64(max(s.replicas.Load(), 1)), s.cfg.MinShare)
}

// keyEscaper keeps tenant and route names from forming each other's keys
// (a tenant "x|r:chat" against tenant x's route chat): the separators in
// a name are escaped; names without them keep the keys they always had.
var keyEscaper = strings.NewReplacer("%", "%25", "|", "%7C", ":", "%3A")

// base is the key base of a tenant's limits, or of its limits on route.
func (s *store) base(tenant, route string, onRoute bool) string {
	b := s.cfg.Redis.KeyPrefix + "t:" + keyEscaper.Replace(tenant)
	if onRoute {
		b += "|r:" + keyEscaper.Replace(route)
	}
	return b
}

// bases are the key bases of a tenant's limits and of its limits on a
// route (when it has some there).
func (s *store) bases(tenant, route string, onRoute bool) []string {
	b := []string{s.base(tenant, "", false)}
	if onRoute {
		b = append(b, s.base(tenant, route, true))
	}
	return b
}

func limitArgs(args []any, l Limits) []any {
	burst := float64(l.Burst)
	if l.RequestsPerSecond > 0 && burst == 0 {
		burst = max(1, math.Ceil(l.RequestsPerSecond))
	}
	return append(args, l.RequestsPerSecond, burst, l.TokensPerMinute, l.MaxConcurrent, l.RequestsPerDay, l.TokensPerDay,
		micro(l.USDPerDay), micro(l.USDPerMonth))
}

// admit checks and takes a request of est tokens against the tenant's
// limits (all) and its route's (rl, may be nil): admitted with its lease,
// or the wait (-1: until a release) and the reason. It is one round trip
// on the caller's goroutine, or none while the breaker is open (errDown).
func (s *store) admit(tenant, route string, all, rl *Limits, est usage) (lease string, wait time.Duration, reason Reason, err error) {
	if !s.up.Load() {
		return "", 0, "", errDown
	}
	keys := s.bases(tenant, route, rl != nil)
	lease = s.id + ":" + strconv.FormatUint(s.seq.Add(1), 36)
	args := []any{est.tokens, lease, s.cfg.LeaseTTL.Seconds(), est.micro}
	// The tenant's releases on their way: the check takes their leases
	// as freed and their tokens as given back, so that a client's next
	// request on a kept-alive connection does not find its last one's
	// slot still taken. Each pending one's tokens count only while its
	// release has not landed; credit is what the ones past maxReleasing
	// give back, counted as they are.
	var credit [2]int64
	s.mu.Lock()
	if r := s.releasing[tenant]; r != nil {
		args = append(args, len(r.pending))
		credit = [2]int64{r.credit, r.routeCredit[route]}
		for _, p := range r.pending {
			var onRoute int64
			if p.hasRoute && p.route == route {
				onRoute = p.back
			}
			args = append(args, p.lease, p.back, onRoute)
			credit[0] -= p.back
			credit[1] -= onRoute
		}
	} else {
		args = append(args, 0)
	}
	s.mu.Unlock()
	for i, l := range []*Limits{all, rl}[:len(keys)] {
		if l == nil {
			l = &Limits{}
		}
		args = limitArgs(append(args, credit[i]), *l)
	}
	var res []any
	err = s.call(s.cfg.Redis.Timeout, func(ctx context.Context) error {
		v, err := admitScript.Run(ctx, s.c, keys, args...).Slice()
		res = v
		return err
	})
	if err != nil {
		return "", 0, "", err
	}
	if len(res) == 1 {
		h := leaseHold{tenant: tenant, route: route, all: all != nil && all.MaxConcurrent > 0, onRoute: rl != nil && rl.MaxConcurrent > 0}
		if h.all || h.onRoute {
			s.mu.Lock()
			s.leases[lease] = h
			s.mu.Unlock()
		}
		return lease, 0, "", nil
	}
	if len(res) != 3 {
		return "", 0, "", errors.New("the admission script answered in an unknown form")
	}
	ws, _ := res[1].(string)
	why, _ := res[2].(string)
	w, _ := strconv.ParseFloat(ws, 64)
	if w < 0 {
		return "", -1, Reason(why), nil
	}
	return "", max(time.Duration(w*float64(time.Second)), time.Nanosecond), Reason(why), nil
}
