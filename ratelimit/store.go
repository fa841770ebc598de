package ratelimit

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"math"
	"strconv"
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

// FailMode says what admission does when the store cannot answer within
// its timeout.
type FailMode string

const (
	// FailClosed refuses (503) while the store is down.
	FailClosed FailMode = "closed"
	// FailOpen falls back to each replica's own limiter, at the tenant's
	// limits divided by the live replicas (never below MinShare of them).
	FailOpen FailMode = "open"
)

// StoreConfig is a shared store.
type StoreConfig struct {
	Redis RedisConfig
	Fail  FailMode
	// LeaseTTL is how long a request's concurrency slot outlives a
	// replica that stopped renewing it (default 15 s).
	LeaseTTL time.Duration
	// MinShare floors each replica's share of a limit when it falls back
	// to its own limiter (FailOpen): limit × max(1/replicas, MinShare).
	MinShare float64
}

// RedisConfig is how to reach Redis.
type RedisConfig struct {
	Addr, Username, Password string
	DB                       int
	TLS                      bool
	// Timeout bounds every store call (default 20 ms).
	Timeout   time.Duration
	KeyPrefix string // default "tokentap:"
}

func (s StoreConfig) withDefaults() StoreConfig {
	if s.Fail == "" {
		s.Fail = FailClosed
	}
	if s.LeaseTTL == 0 {
		s.LeaseTTL = 15 * time.Second
	}
	if s.Redis.Timeout == 0 {
		s.Redis.Timeout = 20 * time.Millisecond
	}
	if s.Redis.KeyPrefix == "" {
		s.Redis.KeyPrefix = "tokentap:"
	}
	return s
}

func (s *StoreConfig) validate() error {
	switch {
	case s.Redis.Addr == "":
		return fieldErr("admission.store.redis.addr", "is required")
	case s.Fail != "" && s.Fail != FailClosed && s.Fail != FailOpen:
		return fieldErr("admission.store.fail", "%q must be closed or open", s.Fail)
	case s.Redis.Timeout < 0:
		return fieldErr("admission.store.redis.timeout", "must not be negative")
	case s.LeaseTTL < 0:
		return fieldErr("admission.store.lease_ttl", "must not be negative")
	case s.MinShare < 0 || s.MinShare > 1:
		return fieldErr("admission.store.min_share", "must be between 0 and 1")
	case s.Redis.DB < 0:
		return fieldErr("admission.store.redis.db", "must not be negative")
	}
	return nil
}

// ReasonStore: the shared store did not answer (fail closed).
const ReasonStore Reason = "store_unavailable"

// store is the shared store's client, shared by the Admitters of
// successive configurations that name the same store.
type store struct {
	c        *redis.Client
	cfg      StoreConfig
	id       string // this replica
	up       atomic.Bool
	replicas atomic.Int64 // live replicas seen in the heartbeats, at least 1
	seq      atomic.Uint64

	mu     sync.Mutex
	leases map[string][]string // lease → the concurrency keys it holds

	calls, failures, nanos atomic.Int64
	onChange               atomic.Pointer[func(up bool)]

	stop chan struct{}
	done chan struct{}
}

// quiet drops the Redis client's own log lines (its dial failures, with
// addresses): the store's transitions are logged once each by tokentap
// (Admitter.OnStoreChange) and its failures counted.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

var quietOnce sync.Once

func newStore(cfg StoreConfig) *store {
	quietOnce.Do(func() { redis.SetLogger(quiet{}) })
	o := &redis.Options{Addr: cfg.Redis.Addr, Username: cfg.Redis.Username, Password: cfg.Redis.Password, DB: cfg.Redis.DB,
		DialTimeout: 4 * cfg.Redis.Timeout, ReadTimeout: cfg.Redis.Timeout, WriteTimeout: cfg.Redis.Timeout,
		MaxRetries: -1, PoolTimeout: cfg.Redis.Timeout, ContextTimeoutEnabled: true}
	if cfg.Redis.TLS {
		o.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	var b [8]byte
	_, _ = rand.Read(b[:])
	s := &store{c: redis.NewClient(o), cfg: cfg, id: hex.EncodeToString(b[:]), leases: map[string][]string{},
		stop: make(chan struct{}), done: make(chan struct{})}
	s.up.Store(true)
	s.replicas.Store(1)
	go s.loop()
	return s
}

func (s *store) close() {
	close(s.stop)
	<-s.done
	_ = s.c.Close()
}

// call runs f within the store's timeout, counting it and following up
// and down.
func (s *store) call(f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.Redis.Timeout)
	defer cancel()
	start := time.Now()
	err := f(ctx)
	s.calls.Add(1)
	s.nanos.Add(int64(time.Since(start)))
	if err != nil && !errors.Is(err, redis.Nil) {
		s.failures.Add(1)
		if s.up.Swap(false) {
			if f := s.onChange.Load(); f != nil {
				(*f)(false)
			}
		}
		return err
	}
	if !s.up.Swap(true) {
		if f := s.onChange.Load(); f != nil {
			(*f)(true)
		}
	}
	return nil
}

// loop beats this replica's heartbeat, counts the live replicas and renews
// the leases of the requests in flight, every LeaseTTL/3 (at most 1 s).
func (s *store) loop() {
	defer close(s.done)
	every := min(s.cfg.LeaseTTL/3, time.Second)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		s.beat(every)
		select {
		case <-s.stop:
			_ = s.call(func(ctx context.Context) error {
				return s.c.ZRem(ctx, s.cfg.Redis.KeyPrefix+"replicas", s.id).Err()
			})
			return
		case <-t.C:
		}
	}
}

func (s *store) beat(every time.Duration) {
	key := s.cfg.Redis.KeyPrefix + "replicas"
	var live int64
	_ = s.call(func(ctx context.Context) error {
		v, err := heartbeatScript.Run(ctx, s.c, []string{key}, s.id, (3 * every).Seconds()).Int64()
		live = v
		return err
	})
	if live > 0 {
		s.replicas.Store(live)
	}
	// Every lease this replica holds, renewed in calls of up to
	// renewBatch: the key of each holding, and its lease beside it.
	var keys []string
	args := []any{s.cfg.LeaseTTL.Seconds()}
	s.mu.Lock()
	for l, held := range s.leases {
		for _, k := range held {
			keys, args = append(keys, k), append(args, l)
		}
	}
	s.mu.Unlock()
	for len(keys) > 0 {
		n := min(len(keys), renewBatch)
		k, a := keys[:n], append([]any{args[0]}, args[1:1+n]...)
		keys, args = keys[n:], append(args[:1], args[1+n:]...)
		_ = s.call(func(ctx context.Context) error { return renewScript.Run(ctx, s.c, k, a...).Err() })
	}
}

// renewBatch bounds the leases one renewal call carries.
const renewBatch = 512

// StoreStats is what a shared store's client has seen.
type StoreStats struct {
	Up                bool
	Calls, Failures   int64
	Seconds           float64 // spent in store calls
	Replicas          int64   // live replicas in the heartbeats
	LeasesHeld        int
	FailOpen, Present bool
}

// StoreStats returns the shared store's figures (Present false: none).
func (a *Admitter) StoreStats() StoreStats {
	s := a.shared
	if s == nil {
		return StoreStats{}
	}
	s.mu.Lock()
	n := len(s.leases)
	s.mu.Unlock()
	return StoreStats{Present: true, Up: s.up.Load(), Calls: s.calls.Load(), Failures: s.failures.Load(),
		Seconds: time.Duration(s.nanos.Load()).Seconds(), Replicas: s.replicas.Load(), LeasesHeld: n, FailOpen: s.cfg.Fail == FailOpen}
}

// OnStoreChange has f called, once per transition, when the shared store
// stops or starts answering.
func (a *Admitter) OnStoreChange(f func(up bool)) {
	if a.shared != nil {
		a.shared.onChange.Store(&f)
	}
}

// shareOf is this replica's share of a limit while it falls back to its
// own limiter.
func (s *store) shareOf() float64 {
	return max(1/float64(max(s.replicas.Load(), 1)), s.cfg.MinShare)
}

// bases are the key bases of a tenant's limits and of its limits on a
// route (when it has some there).
func (s *store) bases(tenant, route string, rl *Limits) []string {
	b := []string{s.cfg.Redis.KeyPrefix + "t:" + tenant}
	if rl != nil {
		b = append(b, s.cfg.Redis.KeyPrefix+"t:"+tenant+"|r:"+route)
	}
	return b
}

func limitArgs(args []any, l Limits) []any {
	burst := float64(l.Burst)
	if l.RequestsPerSecond > 0 && burst == 0 {
		burst = max(1, math.Ceil(l.RequestsPerSecond))
	}
	return append(args, l.RequestsPerSecond, burst, l.TokensPerMinute, l.MaxConcurrent, l.RequestsPerDay, l.TokensPerDay)
}

// admit checks and takes a request of est tokens against the tenant's
// limits (all) and its route's (rl, may be nil): admitted with its lease,
// or the wait (-1: until a release) and the reason.
func (s *store) admit(tenant, route string, all, rl *Limits, est int64) (lease string, wait time.Duration, reason Reason, err error) {
	keys := s.bases(tenant, route, rl)
	lease = s.id + ":" + strconv.FormatUint(s.seq.Add(1), 36)
	args := []any{est, lease, s.cfg.LeaseTTL.Seconds()}
	for _, l := range []*Limits{all, rl}[:len(keys)] {
		if l == nil {
			l = &Limits{}
		}
		args = limitArgs(args, *l)
	}
	var res []any
	err = s.call(func(ctx context.Context) error {
		v, err := admitScript.Run(ctx, s.c, keys, args...).Slice()
		res = v
		return err
	})
	if err != nil {
		return "", 0, "", err
	}
	if len(res) == 1 {
		var held []string
		for i, l := range []*Limits{all, rl}[:len(keys)] {
			if l != nil && l.MaxConcurrent > 0 {
				held = append(held, keys[i]+":conc")
			}
		}
		if len(held) > 0 {
			s.mu.Lock()
			s.leases[lease] = held
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

// release ends an admitted request: its lease goes and its token
// reservations are reconciled with actual.
func (s *store) release(tenant, route string, all, rl *Limits, lease string, reserved, actual int64) {
	s.mu.Lock()
	delete(s.leases, lease)
	s.mu.Unlock()
	keys := s.bases(tenant, route, rl)
	args := []any{lease, reserved, actual}
	for _, l := range []*Limits{all, rl}[:len(keys)] {
		if l == nil {
			l = &Limits{}
		}
		args = limitArgs(args, *l)
	}
	_ = s.call(func(ctx context.Context) error { return releaseScript.Run(ctx, s.c, keys, args...).Err() })
}

// The scripts. Each limit set i has six arguments after the first three:
// requests per second, burst, tokens per minute, max concurrent, requests
// per day, tokens per day (0: none).
var admitScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local day = math.floor(tonumber(t[1]) / 86400)
local untilDay = (day + 1) * 86400 - now
local est, lease, ttl = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local wait, reason = 0, ''
local st = {}
for i = 1, #KEYS do
  local o = 3 + (i - 1) * 6
  local rps, burst, tpm, maxc, rpd, tpd = tonumber(ARGV[o+1]), tonumber(ARGV[o+2]), tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+5]), tonumber(ARGV[o+6])
  local b = KEYS[i]
  local s = {}
  if maxc > 0 then
    redis.call('ZREMRANGEBYSCORE', b .. ':conc', '-inf', now)
    if redis.call('ZCARD', b .. ':conc') >= maxc then
      return {0, '-1', 'concurrency'}
    end
  end
  if rps > 0 then
    local v = redis.call('HMGET', b .. ':rps', 'l', 't')
    local l, ts = tonumber(v[1]) or burst, tonumber(v[2]) or now
    l = math.min(burst, l + math.max(0, now - ts) * rps)
    s.rps = l
    if l < 1 and (1 - l) / rps > wait then wait, reason = (1 - l) / rps, 'requests' end
  end
  if tpm > 0 then
    local v = redis.call('HMGET', b .. ':tpm', 'l', 't')
    local l, ts = tonumber(v[1]) or tpm, tonumber(v[2]) or now
    l = math.min(tpm, l + math.max(0, now - ts) * tpm / 60)
    s.tpm = l
    local need = math.min(est, tpm)
    if l < need and (need - l) / (tpm / 60) > wait then wait, reason = (need - l) / (tpm / 60), 'tokens' end
  end
  if rpd > 0 and tonumber(redis.call('GET', b .. ':rpd:' .. day) or '0') >= rpd and untilDay > wait then
    wait, reason = untilDay, 'requests_per_day'
  end
  if tpd > 0 and tonumber(redis.call('GET', b .. ':tpd:' .. day) or '0') + math.min(est, tpd) > tpd and untilDay > wait then
    wait, reason = untilDay, 'tokens_per_day'
  end
  st[i] = s
end
if wait > 0 then
  return {0, tostring(wait), reason}
end
for i = 1, #KEYS do
  local o = 3 + (i - 1) * 6
  local rps, burst, tpm, maxc, rpd, tpd = tonumber(ARGV[o+1]), tonumber(ARGV[o+2]), tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+5]), tonumber(ARGV[o+6])
  local b, s = KEYS[i], st[i]
  if maxc > 0 then
    redis.call('ZADD', b .. ':conc', now + ttl, lease)
    redis.call('EXPIRE', b .. ':conc', math.ceil(ttl) + 60)
  end
  if rps > 0 then
    local l = s.rps - 1
    redis.call('HSET', b .. ':rps', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':rps', math.ceil((burst - l) / rps) + 60)
  end
  if tpm > 0 then
    local l = s.tpm - est
    redis.call('HSET', b .. ':tpm', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':tpm', math.ceil((tpm - l) / (tpm / 60)) + 60)
  end
  if rpd > 0 then
    redis.call('INCR', b .. ':rpd:' .. day)
    redis.call('EXPIRE', b .. ':rpd:' .. day, 2 * 86400)
  end
  if tpd > 0 then
    redis.call('INCRBY', b .. ':tpd:' .. day, est)
    redis.call('EXPIRE', b .. ':tpd:' .. day, 2 * 86400)
  end
end
return {1}
`)

var releaseScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local day = math.floor(tonumber(t[1]) / 86400)
local lease, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, #KEYS do
  local o = 3 + (i - 1) * 6
  local tpm, maxc, tpd = tonumber(ARGV[o+3]), tonumber(ARGV[o+4]), tonumber(ARGV[o+6])
  local b = KEYS[i]
  if maxc > 0 then redis.call('ZREM', b .. ':conc', lease) end
  if tpm > 0 and reserved ~= actual then
    local v = redis.call('HMGET', b .. ':tpm', 'l', 't')
    local l, ts = tonumber(v[1]) or tpm, tonumber(v[2]) or now
    l = math.min(tpm, l + math.max(0, now - ts) * tpm / 60 + reserved - actual)
    redis.call('HSET', b .. ':tpm', 'l', l, 't', now)
    redis.call('EXPIRE', b .. ':tpm', math.ceil((tpm - l) / (tpm / 60)) + 60)
  end
  if tpd > 0 and reserved ~= actual then
    local k = b .. ':tpd:' .. day
    local left = redis.call('INCRBY', k, actual - reserved)
    if left < 0 then redis.call('SET', k, 0) end
    redis.call('EXPIRE', k, 2 * 86400)
  end
end
return 1
`)

// renewScript: ARGV[1] the lease time, then for each key the lease it
// holds in it.
var renewScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', now + ttl, ARGV[i + 1])
  redis.call('EXPIRE', KEYS[i], math.ceil(ttl) + 60)
end
return 1
`)

var heartbeatScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])) + 60)
return redis.call('ZCARD', KEYS[1])
`)
