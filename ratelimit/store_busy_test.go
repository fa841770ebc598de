package ratelimit

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// TestHealthyStoreOnABusyMachine: a healthy Redis, fail: closed, three
// replicas with 16 clients each, beside 8 goroutines that spin (a busy
// machine: every goroutine waits for a processor, often longer than the
// store's 100 ms timeout). (Almost) no request is refused for the
// store, no release is dropped, and (almost) no call fails: the store
// answered in time, tokentap was slow to ask. Before, 59-135 of ~2,800 calls failed on this machine
// and the breaker tripped (118,000-577,000 refusals in 5 s).
func TestHealthyStoreOnABusyMachine(t *testing.T) {
	long(t, "3 s of load beside spinning goroutines")
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{RequestsPerSecond: 1e6, Burst: 1e6, MaxConcurrent: 1000, TokensPerMinute: 1e9}}}}
	cfg.Store = &StoreConfig{Redis: RedisConfig{Addr: r.Addr, KeyPrefix: fmt.Sprintf("busy%d:", time.Now().UnixNano())}, Fail: FailClosed}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var reps []*Admitter
	for range 3 {
		a := New(cfg, nil, nil) // the store's timeout at its default, 100 ms
		t.Cleanup(a.Close)
		reps = append(reps, a)
	}
	stop := make(chan struct{})
	var spinners sync.WaitGroup
	for range 8 {
		spinners.Add(1)
		go func() {
			defer spinners.Done()
			for x := 0; ; x++ {
				if x%100_000 == 0 {
					select {
					case <-stop:
						return
					default:
					}
				}
			}
		}()
	}
	var admitted, refused atomic.Int64
	var clients sync.WaitGroup
	deadline := time.Now().Add(3 * time.Second)
	for _, a := range reps {
		for range 16 {
			clients.Add(1)
			go func() {
				defer clients.Done()
				for time.Now().Before(deadline) {
					tk, ref := a.Admit(context.Background(), "a", "chat", 10)
					if ref != nil {
						refused.Add(1)
						continue
					}
					admitted.Add(1)
					time.Sleep(2 * time.Millisecond)
					tk.Release(5)
				}
			}()
		}
	}
	clients.Wait()
	close(stop)
	spinners.Wait()
	settled(t, reps...)
	var calls, failures, dropped int64
	for _, a := range reps {
		s := a.StoreStats()
		calls, failures, dropped = calls+s.Calls, failures+s.Failures, dropped+s.ReleasesDropped
	}
	t.Logf("admitted %d, refused %d; %d calls, %d failed, %d releases dropped", admitted.Load(), refused.Load(), calls, failures, dropped)
	// What is left: a client goroutine held from a processor for longer
	// than the timeout between its write and its read finds its read
	// deadline past and the reply unread (Go's poller checks the deadline
	// before the socket), and with fail: closed that request is refused:
	// 1 of 1,636 calls and 1 of 1,503 requests in one CI run, 1 of 2,297
	// calls (none refused) in another. Before the fix this test guards,
	// 2-5% of calls failed and the breaker refused 118,000-577,000
	// requests; a failure in 200 calls or a refusal in 200 requests is
	// past what is left.
	if refused.Load()*200 > admitted.Load() || failures*200 > calls || dropped != 0 || admitted.Load() == 0 {
		t.Errorf("a healthy store on a busy machine: %d admitted, %d refused, %d of %d calls failed, %d releases dropped; want under 0.5%% refused and under 0.5%% failed",
			admitted.Load(), refused.Load(), failures, calls, dropped)
	}
}

// TestTenantWithoutLimitsNeverAsksTheStore: a tenant with no limits of its
// own or on its route, beside one with limits, on a shared store with
// fail: closed. While Redis is stopped, or hung (paused), its requests are
// admitted at once, with no call to the store; the other's are refused
// for the store. Before, 5 of 5 got 503 while Redis was stopped.
func TestTenantWithoutLimitsNeverAsksTheStore(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "free"}, {Name: "capped", Limits: Limits{MaxConcurrent: 2}},
		{Name: "elsewhere", Routes: map[string]Limits{"other": {MaxConcurrent: 1}}}}}
	a := replicas(t, 1, cfg, r.Addr, FailClosed)[0]
	check := func(state string) {
		t.Helper()
		calls := a.StoreStats().Calls
		for _, tenant := range []string{"free", "elsewhere"} {
			for range 5 {
				tk, ref := a.Admit(context.Background(), tenant, "chat", 1)
				if ref != nil {
					t.Fatalf("Redis %s: %s, without limits on the route, refused: %s", state, tenant, ref.Reason)
				}
				tk.Release(1)
			}
		}
		if n := a.StoreStats().Calls - calls; n != 0 {
			t.Errorf("Redis %s: 10 requests of tenants without limits made %d store calls", state, n)
		}
		if _, ref := a.Admit(context.Background(), "capped", "chat", 1); ref == nil || ref.Reason != ReasonStore {
			t.Errorf("Redis %s: the capped tenant %v, want refused for the store", state, ref)
		}
	}
	r.Pause()
	check("hung")
	r.Resume()
	r.Stop()
	check("stopped")
}

// TestReleasesSentAgainAfterTheStoreCameBack: with Redis hung, a release
// cannot be sent; it is kept and sent once Redis answers again: the slot
// and the unused tokens come back in the store (another replica is
// admitted), nothing is dropped. Before, every such release was dropped
// (113 in one loaded run): the slot came back only when its lease ran
// out, and the tokens never.
func TestReleasesSentAgainAfterTheStoreCameBack(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 1, TokensPerMinute: 1000}}}}
	reps := replicas(t, 2, cfg, r.Addr, FailClosed)
	tk, ref := reps[0].Admit(context.Background(), "a", "chat", 900)
	if ref != nil {
		t.Fatal(ref.Reason)
	}
	r.Pause()
	tk.Release(100) // 800 tokens back, and the slot
	waitUntil(t, func() bool { return reps[0].StoreStats().ReleasesRetried > 0 })
	r.Resume()
	settled(t, reps[0])
	if s := reps[0].StoreStats(); s.ReleasesDropped != 0 {
		t.Errorf("%d releases dropped", s.ReleasesDropped)
	}
	tk2, ref := reps[1].Admit(context.Background(), "a", "chat", 800)
	if ref != nil {
		t.Fatalf("the other replica after the store came back: %s (the release did not land)", ref.Reason)
	}
	tk2.Release(800)
}

// TestAReleaseSentTwiceLandsOnce: a release sent again after a call that
// failed once it had landed gives its tokens back once.
func TestAReleaseSentTwiceLandsOnce(t *testing.T) {
	r := redistest.Start(t)
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{TokensPerMinute: 1000}}}}
	a := replicas(t, 1, cfg, r.Addr, FailClosed)[0]
	ta, _ := a.Admit(context.Background(), "a", "chat", 500)
	if _, ref := a.Admit(context.Background(), "a", "chat", 400); ref != nil {
		t.Fatal(ref.Reason)
	}
	all, _ := a.states["a"].limitsOn("chat")
	op := releaseOp{tenant: "a", route: "chat", lease: ta.adm.lease, all: *all, reserved: usage{tokens: 500}, since: time.Now()}
	ta.released.Store(true) // released by hand, twice
	for range 2 {
		if err := a.shared.sendReleases([]releaseOp{op}); err != nil {
			t.Fatal(err)
		}
	}
	// 100 left, 500 back once: 600 (and a little refill), never 1000.
	if tk, ref := a.Admit(context.Background(), "a", "chat", 800); ref == nil {
		tk.Release(800)
		t.Fatal("800 tokens admitted: the release gave its 500 back twice")
	}
	if _, ref := a.Admit(context.Background(), "a", "chat", 550); ref != nil {
		t.Fatalf("550 tokens refused (%s): the release did not land", ref.Reason)
	}
}

// waitUntil polls cond until it holds, failing after a minute (a hang).
func waitUntil(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); !cond(); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not within a minute")
		}
	}
}
