package ratelimit

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// storeAt is a shared store configuration at addr under a fresh prefix.
func storeAt(addr string, timeout time.Duration, fail FailMode) *StoreConfig {
	return &StoreConfig{Redis: RedisConfig{Addr: addr, Timeout: timeout, KeyPrefix: fmt.Sprintf("fleet%d:", time.Now().UnixNano())},
		Fail: fail, LeaseTTL: time.Second}
}

// One tenant's decisions do not wait for each other: with the store 50 ms
// away each way (a round trip of 100 ms), 16 requests of one tenant at
// once are all decided in about one round trip, where decisions made one
// after another under the tenant's lock took 16. A release does not wait
// for the store, and a kept-alive client's next request does not find
// its last one's slot still taken (max_concurrent 1).
func TestSharedDecisionsRunSideBySide(t *testing.T) {
	long(t, "decisions against a delayed Redis")
	r := redistest.Start(t)
	const oneWay = 50 * time.Millisecond
	addr := r.Delayed(oneWay)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 1}},
		{Name: "b", Limits: Limits{RequestsPerSecond: 1e6, TokensPerMinute: 1e12, MaxConcurrent: 100}}},
		Store: storeAt(addr, 2*time.Second, FailClosed)}
	a := New(cfg, nil, nil)
	defer a.Close()

	start := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var tickets []*Ticket
	for range 16 {
		wg.Go(func() {
			tk, ref := a.Admit(context.Background(), "b", "chat", 100)
			if ref != nil {
				t.Errorf("refused: %s", ref.Reason)
				return
			}
			mu.Lock()
			tickets = append(tickets, tk)
			mu.Unlock()
		})
	}
	wg.Wait()
	took := time.Since(start)
	t.Logf("16 decisions of one tenant at once, store 100 ms a round trip: %v", took.Round(time.Millisecond))
	if took > 8*2*oneWay {
		t.Fatalf("16 decisions took %v: they waited for each other (one after another: %v)", took, 16*2*oneWay)
	}
	for _, tk := range tickets {
		start := time.Now()
		tk.Release(50)
		if d := time.Since(start); d > oneWay {
			t.Fatalf("a release took %v: it waited for the store", d)
		}
	}

	// A kept-alive client of tenant a (one at a time): each request is
	// admitted as the last one's release is on its way.
	for i := range 5 {
		tk, ref := a.Admit(context.Background(), "a", "chat", 1)
		if ref != nil {
			t.Fatalf("request %d of a client one at a time refused: %s (its last one's slot)", i, ref.Reason)
		}
		tk.Release(1)
	}
	// And the slot is taken for real: a second at once is refused.
	tk, ref := a.Admit(context.Background(), "a", "chat", 1)
	if ref != nil {
		t.Fatal(ref.Reason)
	}
	if _, ref := a.Admit(context.Background(), "a", "chat", 1); ref == nil || ref.Reason != ReasonConcurrency {
		t.Fatalf("a second request at once with max_concurrent 1: %v", ref)
	}
	tk.Release(1)
}

// Redis hung (SIGSTOP) under 16 clients of one tenant: no decision waits
// in line behind another's timeout; once tripAfter calls failed the
// breaker answers at once, closed with 503s and open from this replica's
// share, until a probe is answered after Redis resumes.
func TestSharedStoreHung(t *testing.T) {
	long(t, "Redis paused under load")
	for _, fail := range []FailMode{FailClosed, FailOpen} {
		t.Run(string(fail), func(t *testing.T) {
			r := redistest.Start(t)
			const timeout = 50 * time.Millisecond
			cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{RequestsPerSecond: 1e6, MaxConcurrent: 1000}}},
				Store: storeAt(r.Addr, timeout, fail)}
			a := New(cfg, nil, nil)
			defer a.Close()
			if _, ref := a.Admit(context.Background(), "a", "chat", 1); ref != nil {
				t.Fatal(ref.Reason)
			}
			r.Pause()
			var mu sync.Mutex
			var lat []time.Duration
			admitted, refused := 0, 0
			var wg sync.WaitGroup
			stopAt := time.Now().Add(time.Second)
			for range 16 {
				wg.Go(func() {
					for time.Now().Before(stopAt) {
						start := time.Now()
						tk, ref := a.Admit(context.Background(), "a", "chat", 1)
						d := time.Since(start)
						mu.Lock()
						lat = append(lat, d)
						if ref == nil {
							admitted++
						} else if ref.Reason == ReasonStore {
							refused++
						} else {
							t.Errorf("refused for %s", ref.Reason)
						}
						mu.Unlock()
						tk.Release(1)
						time.Sleep(time.Millisecond)
					}
				})
			}
			wg.Wait()
			slices.Sort(lat)
			p99, worst := lat[len(lat)*99/100], lat[len(lat)-1]
			slow := 0
			for _, d := range lat {
				if d >= timeout/2 {
					slow++
				}
			}
			t.Logf("Redis hung, fail %s: %d decisions (%d admitted, %d refused), p99 %v, worst %v, %d waited on the store",
				fail, len(lat), admitted, refused, p99.Round(time.Microsecond), worst.Round(time.Millisecond), slow)
			if p99 > 100*time.Millisecond {
				t.Errorf("p99 of the decisions %v with Redis hung: want at most 100 ms", p99)
			}
			if worst > 4*timeout {
				t.Errorf("a decision took %v against a %v timeout: it waited in line", worst, timeout)
			}
			if slow > 3*16 {
				t.Errorf("%d decisions waited on a hung store: the breaker should answer after %d failures", slow, tripAfter)
			}
			switch fail {
			case FailClosed:
				if admitted > 0 || refused < 16 {
					t.Errorf("fail closed: %d admitted, %d refused", admitted, refused)
				}
			case FailOpen:
				if refused > 0 || admitted < 500 {
					t.Errorf("fail open: %d admitted, %d refused in a second of 16 clients", admitted, refused)
				}
			}
			// Down while hung. A reply Redis wrote just before it stopped
			// may be read late on a busy machine (the delay-link tests'
			// forwarder runs at real-time priority beside this one) and
			// read the store up for a moment; the next calls that fail
			// take it down again, within a few heartbeats.
			for deadline := time.Now().Add(10 * time.Second); a.StoreStats().Up; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the store reads up while hung")
				}
			}
			r.Resume()
			for deadline := time.Now().Add(5 * time.Second); !a.StoreStats().Up; time.Sleep(10 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("Redis resumed, the breaker stays open")
				}
			}
			tk, ref := a.Admit(context.Background(), "a", "chat", 1)
			if ref != nil {
				t.Fatalf("Redis back, refused: %s", ref.Reason)
			}
			tk.Release(1)
		})
	}
}

// A store down when the Admitter is made starts with its breaker open: the
// first decision does not wait for a dial that cannot succeed.
func TestSharedStoreDownAtStart(t *testing.T) {
	r := redistest.Start(t)
	addr := r.Addr
	r.Stop()
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 2}}}, Store: storeAt(addr, 50*time.Millisecond, FailClosed)}
	a := New(cfg, nil, nil)
	defer a.Close()
	var up []bool
	a.OnStoreChange(func(u bool, err error) { up = append(up, u) })
	if a.StoreStats().Up || len(up) != 1 || up[0] {
		t.Fatalf("a store down at start reads up (changes seen: %v)", up)
	}
	start := time.Now()
	if _, ref := a.Admit(context.Background(), "a", "chat", 1); ref == nil || ref.Reason != ReasonStore {
		t.Fatalf("store down: %v", ref)
	}
	if d := time.Since(start); d > 10*time.Millisecond {
		t.Errorf("a decision with the breaker open took %v", d)
	}
}

// A reload that changes the store (here its timeout and key prefix) hands
// the leases of the requests in flight to the new one: past the lease time
// they still hold their slots there, and their releases free them.
func TestSharedLeasesHandedOverOnReload(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 2}}}, Store: storeAt(r.Addr, time.Second, FailClosed)}
	a := New(cfg, nil, nil)
	var held []*Ticket
	for range 2 {
		tk, ref := a.Admit(context.Background(), "a", "chat", 1)
		if ref != nil {
			t.Fatal(ref.Reason)
		}
		held = append(held, tk)
	}
	next := cfg
	next.Store = storeAt(r.Addr, 500*time.Millisecond, FailClosed)
	b := New(next, nil, a)
	defer b.Close()
	if n := b.StoreStats().LeasesHeld; n != 2 {
		t.Fatalf("the new store holds %d leases, want the 2 in flight", n)
	}
	time.Sleep(1500 * time.Millisecond) // past the lease time: renewed by the new store
	if _, ref := b.Admit(context.Background(), "a", "chat", 1); ref == nil || ref.Reason != ReasonConcurrency {
		t.Fatalf("a third request after the reload: %v (the two in flight lost their slots)", ref)
	}
	for _, tk := range held {
		tk.Release(1)
	}
	for deadline := time.Now().Add(time.Second); ; time.Sleep(5 * time.Millisecond) {
		tk, ref := b.Admit(context.Background(), "a", "chat", 1)
		if ref == nil {
			tk.Release(1)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the requests from before the reload ended, their slots stay taken: %s", ref.Reason)
		}
	}
	if n := b.StoreStats().LeasesHeld; n != 0 {
		t.Fatalf("%d leases held after every request ended", n)
	}
}

// Redis restarted without persistence loses the leases; the replica puts
// those of its requests in flight back at its next renewal.
func TestSharedLeasesRestoredAfterRestart(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 2}}}, Store: storeAt(r.Addr, time.Second, FailClosed)}
	a := New(cfg, nil, nil)
	defer a.Close()
	for range 2 {
		if _, ref := a.Admit(context.Background(), "a", "chat", 1); ref != nil {
			t.Fatal(ref.Reason)
		}
	}
	r.Stop()
	r.Restart()
	time.Sleep(800 * time.Millisecond) // a renewal (every third of the lease time) or a probe
	if _, ref := a.Admit(context.Background(), "a", "chat", 1); ref == nil || ref.Reason != ReasonConcurrency {
		t.Fatalf("after a restart that lost the leases: %v, want the two in flight to hold their slots", ref)
	}
}

// Tenant and route names cannot form each other's keys: a tenant named
// "x|r:chat" does not share tenant x's limits on route chat.
func TestSharedKeysOfNamesWithSeparators(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{
		{Name: "x", Routes: map[string]Limits{"chat": {MaxConcurrent: 1}}},
		{Name: "x|r:chat", Limits: Limits{MaxConcurrent: 1}},
		{Name: "y:conc", Limits: Limits{MaxConcurrent: 1}},
		{Name: "y", Limits: Limits{MaxConcurrent: 1}},
	}, Store: storeAt(r.Addr, time.Second, FailClosed)}
	a := New(cfg, nil, nil)
	defer a.Close()
	for _, c := range [][2]string{{"x", "chat"}, {"x|r:chat", "other"}, {"y", "chat"}, {"y:conc", "chat"}} {
		if _, ref := a.Admit(context.Background(), c[0], c[1], 1); ref != nil {
			t.Fatalf("tenant %q on %s refused (%s): it shares another's keys", c[0], c[1], ref.Reason)
		}
	}
	keys, err := r.Client().Keys(context.Background(), cfg.Store.Redis.KeyPrefix+"t:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	want := []string{"t:x%7Cr%3Achat:conc", "t:x|r:chat:conc", "t:y%3Aconc:conc", "t:y:conc"}
	for i := range keys {
		keys[i] = strings.TrimPrefix(keys[i], cfg.Store.Redis.KeyPrefix)
	}
	if !slices.Equal(keys, want) {
		t.Fatalf("keys %q, want %q", keys, want)
	}
}

// Lease times and timeouts below their floors are refused with the field
// named: a lease renewed every third of 2 ns would stop every stream.
func TestStoreFloors(t *testing.T) {
	for _, c := range []struct {
		s     StoreConfig
		field string
	}{
		{StoreConfig{Redis: RedisConfig{Addr: "r:6379"}, LeaseTTL: 2}, "admission.store.lease_ttl"},
		{StoreConfig{Redis: RedisConfig{Addr: "r:6379"}, LeaseTTL: time.Millisecond}, "admission.store.lease_ttl"},
		{StoreConfig{Redis: RedisConfig{Addr: "r:6379", Timeout: time.Microsecond}}, "admission.store.redis.timeout"},
	} {
		cfg := Config{Tenants: []Tenant{{Name: "a"}}, Store: &c.s}
		err := cfg.Validate()
		fe, ok := err.(*FieldError)
		if !ok || fe.Field() != c.field {
			t.Errorf("%+v: %v, want an error on %s", c.s, err, c.field)
		}
	}
	ok := Config{Tenants: []Tenant{{Name: "a"}}, Store: &StoreConfig{Redis: RedisConfig{Addr: "r:6379"}, LeaseTTL: time.Second}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
}
