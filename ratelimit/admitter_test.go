package ratelimit

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
)

// clock is a test clock that only moves when told to.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Unix(1_700_000_000, 0)} }

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newAdmitter(t *testing.T, c *clock, mode Mode, tenants ...Tenant) *Admitter {
	t.Helper()
	cfg := Config{Tenants: tenants, Mode: mode, MaxQueue: 100, MaxWait: 2 * time.Second, Store: testStore}
	if testStore != nil {
		// Each admitter its own keys: the tests reuse tenant names.
		s := *testStore
		s.Redis.KeyPrefix = fmt.Sprintf("%s%d:", s.Redis.KeyPrefix, storeRuns.Add(1))
		cfg.Store = &s
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	var now func() time.Time
	if c != nil {
		now = c.now
	}
	a := New(cfg, now, nil)
	t.Cleanup(a.Close)
	return a
}

// A tenant limited to r requests per second with burst b gets r×T + b
// requests over T, whatever it asks for.
func TestRequestRateOverTime(t *testing.T) {
	for _, tc := range []struct {
		rps   float64
		burst int
	}{{5, 5}, {2, 10}, {0.5, 1}, {100, 20}} {
		c := newClock()
		a := newAdmitter(t, c, ModeReject, Tenant{Name: "a", Limits: Limits{RequestsPerSecond: tc.rps, Burst: tc.burst}})
		const T = 10 * time.Second
		admitted := 0
		for elapsed := time.Duration(0); elapsed <= T; elapsed += time.Millisecond {
			for range 3 { // asks far above the limit
				if tk, ref := a.Admit(context.Background(), "a", "r", 0); ref == nil {
					admitted++
					tk.Release(0)
				} else if ref.Reason != ReasonRequests || ref.RetryAfter <= 0 || ref.RetryAfter > time.Duration(float64(time.Second)/tc.rps)+time.Millisecond {
					t.Fatalf("refusal %+v", ref)
				}
			}
			c.add(time.Millisecond)
		}
		want := int(tc.rps*T.Seconds()) + tc.burst
		if admitted < want-1 || admitted > want+1 {
			t.Errorf("rps=%v burst=%d: admitted %d over %v, want %d±1", tc.rps, tc.burst, admitted, T, want)
		}
	}
}

// One tenant at 10× its limit never throttles another at half of its own.
func TestTenantsAreIsolated(t *testing.T) {
	c := newClock()
	lim := Limits{RequestsPerSecond: 10, Burst: 10}
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "noisy", Limits: lim}, Tenant{Name: "quiet", Limits: lim})
	noisyOK, quietRefused := 0, 0
	for ms := 0; ms < 20_000; ms++ {
		if tk, ref := a.Admit(context.Background(), "noisy", "r", 0); ref == nil { // 1000/s: 100× its limit
			noisyOK++
			tk.Release(0)
		}
		if ms%200 == 0 { // 5/s: half its limit
			if tk, ref := a.Admit(context.Background(), "quiet", "r", 0); ref != nil {
				quietRefused++
			} else {
				tk.Release(0)
			}
		}
		c.add(time.Millisecond)
	}
	if quietRefused != 0 {
		t.Fatalf("the quiet tenant was refused %d times", quietRefused)
	}
	if noisyOK > 10*20+10+1 {
		t.Fatalf("the noisy tenant got %d", noisyOK)
	}
}

// The same with queueing, on synctest's fake clock: the quiet tenant never
// waits while the noisy one floods its own queue.
func TestFairQueueAcrossTenants(t *testing.T) {
	synctest.Test(t, testFairQueueAcrossTenants)
}

func testFairQueueAcrossTenants(t *testing.T) {
	a := newAdmitter(t, nil, ModeQueue,
		Tenant{Name: "noisy", Limits: Limits{RequestsPerSecond: 20, Burst: 2}},
		Tenant{Name: "quiet", Limits: Limits{RequestsPerSecond: 20, Burst: 2}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for range 40 { // 40 concurrent noisy clients, each retrying at once
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if tk, ref := a.Admit(ctx, "noisy", "r", 0); ref == nil {
					tk.Release(0)
				} else {
					time.Sleep(time.Millisecond) // retry, as a client would
				}
			}
		}()
	}
	time.Sleep(100 * time.Millisecond) // the noisy queue fills
	if _, q := a.Stats("noisy"); q == 0 {
		t.Fatal("the noisy tenant never queued: the test proves nothing")
	}
	var worst time.Duration
	for range 10 { // 10/s: half the quiet tenant's limit
		tk, ref := a.Admit(context.Background(), "quiet", "r", 0)
		if ref != nil {
			t.Fatalf("quiet refused: %+v", ref)
		}
		worst = max(worst, tk.Queued)
		tk.Release(0)
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	if worst != 0 {
		t.Fatalf("the quiet tenant waited up to %v behind the noisy one", worst)
	}
}

// A request reserves its estimate before it goes; the reservation is
// reconciled with the real usage when it ends.
func TestTokenBudgetReserveAndReconcile(t *testing.T) {
	c := newClock()
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "a", Limits: Limits{TokensPerMinute: 6000}})
	t1, ref := a.Admit(context.Background(), "a", "r", 4000)
	if ref != nil {
		t.Fatal(ref)
	}
	// 2000 left: a second 4000-token request must wait 2000/(6000/60 per s) = 20 s.
	if _, ref = a.Admit(context.Background(), "a", "r", 4000); ref == nil || ref.Reason != ReasonTokens || ref.RetryAfter != 20*time.Second {
		t.Fatalf("second request: %+v", ref)
	}
	if _, tok := a.Quotas("a", "r"); tok.Remaining != 2000 || tok.Limit != 6000 || tok.Reset != 40*time.Second {
		t.Fatalf("token quota %+v", tok)
	}
	t1.Release(500) // it used only 500: 3500 come back
	t1.Release(500) // twice changes nothing
	t2, ref := a.Admit(context.Background(), "a", "r", 4000)
	if ref != nil {
		t.Fatalf("after reconcile: %+v", ref)
	}
	t2.Release(9000) // it used more than reserved: the budget goes into debt
	if _, tok := a.Quotas("a", "r"); tok.Remaining != 0 {
		t.Fatalf("remaining %d after overuse", tok.Remaining)
	}
	// 5500 − 9000 = −3500: 100 tokens need 3600 tokens of refill = 36 s.
	if _, ref = a.Admit(context.Background(), "a", "r", 100); ref == nil || ref.RetryAfter != 36*time.Second {
		t.Fatalf("in debt: %+v", ref)
	}
	c.add(36 * time.Second)
	if tk, ref := a.Admit(context.Background(), "a", "r", 100); ref != nil {
		t.Fatalf("after the debt refilled: %+v", ref)
	} else {
		tk.Release(0) // aborted before anything was used: all refunded
	}
	if _, tok := a.Quotas("a", "r"); tok.Remaining != 100 {
		t.Fatalf("refund: remaining %d, want 100", tok.Remaining)
	}
}

// A request larger than a small budget is admitted when the budget is full
// (a fixed reservation bigger than the budget would refuse it forever).
func TestLargeRequestOnSmallBudget(t *testing.T) {
	c := newClock()
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "a", Limits: Limits{TokensPerMinute: 500}})
	tk, ref := a.Admit(context.Background(), "a", "r", 2000)
	if ref != nil {
		t.Fatalf("first request on a full small budget refused: %+v", ref)
	}
	tk.Release(300)
	if _, ref := a.Admit(context.Background(), "a", "r", 2000); ref == nil {
		t.Fatal("second large request admitted before the budget refilled")
	}
}

// 50 concurrent requests against a budget that admits 10 admit exactly 10.
func TestConcurrentRequestsCannotShareTheSameBudget(t *testing.T) {
	for name, lim := range map[string]Limits{
		"tokens":      {TokensPerMinute: 1000},
		"concurrency": {MaxConcurrent: 10},
		"requests":    {RequestsPerSecond: 1, Burst: 10},
	} {
		c := newClock()
		a := newAdmitter(t, c, ModeReject, Tenant{Name: "a", Limits: lim})
		var admitted atomic.Int64
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range 50 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				if _, ref := a.Admit(context.Background(), "a", "r", 100); ref == nil {
					admitted.Add(1)
				}
			}()
		}
		close(start)
		wg.Wait()
		if n := admitted.Load(); n != 10 {
			t.Errorf("%s: %d of 50 admitted, want exactly 10", name, n)
		}
		if in, _ := a.Stats("a"); in != 10 {
			t.Errorf("%s: in flight %d", name, in)
		}
	}
}

func TestQueueWaitsForARelease(t *testing.T) { synctest.Test(t, testQueueWaitsForARelease) }

func testQueueWaitsForARelease(t *testing.T) {
	a := newAdmitter(t, nil, ModeQueue, Tenant{Name: "a", Limits: Limits{MaxConcurrent: 1}})
	first, _ := a.Admit(context.Background(), "a", "r", 0)
	got := make(chan *Ticket)
	go func() {
		tk, _ := a.Admit(context.Background(), "a", "r", 0)
		got <- tk
	}()
	synctest.Wait()
	if _, q := a.Stats("a"); q != 1 {
		t.Fatalf("queued: %d", q)
	}
	time.Sleep(30 * time.Millisecond)
	first.Release(0)
	tk := <-got
	if tk == nil || tk.Queued != 30*time.Millisecond {
		t.Fatalf("queued ticket %+v", tk)
	}
	tk.Release(0)
	if in, q := a.Stats("a"); in != 0 || q != 0 {
		t.Fatalf("gauges after: in flight %d queued %d", in, q)
	}
}

// A client that leaves while queued leaves the queue at once and takes
// nothing with it.
func TestCancelWhileQueued(t *testing.T) { synctest.Test(t, testCancelWhileQueued) }

func testCancelWhileQueued(t *testing.T) {
	a := newAdmitter(t, nil, ModeQueue, Tenant{Name: "a", Limits: Limits{MaxConcurrent: 1, TokensPerMinute: 6000}})
	holder, _ := a.Admit(context.Background(), "a", "r", 1000)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan *Refusal)
	go func() {
		_, ref := a.Admit(ctx, "a", "r", 1000)
		done <- ref
	}()
	synctest.Wait()
	cancel()
	start := time.Now()
	ref := <-done
	if ref == nil || ref.Reason != ReasonCancelled || time.Since(start) != 0 {
		t.Fatalf("cancel: %+v after %v", ref, time.Since(start))
	}
	if in, q := a.Stats("a"); in != 1 || q != 0 {
		t.Fatalf("after cancel: in flight %d queued %d", in, q)
	}
	holder.Release(1000)
	if _, tok := a.Quotas("a", "r"); tok.Remaining < 4999 {
		t.Fatalf("the cancelled request took tokens: %d remaining", tok.Remaining)
	}
}

func TestQueueFullAndTimeout(t *testing.T) { synctest.Test(t, testQueueFullAndTimeout) }

func testQueueFullAndTimeout(t *testing.T) {
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{MaxConcurrent: 1}}}, Mode: ModeQueue, MaxQueue: 2, MaxWait: 150 * time.Millisecond}
	a := New(cfg, nil, nil)
	defer a.Close()
	holder, _ := a.Admit(context.Background(), "a", "r", 0)
	defer holder.Release(0)
	refs := make(chan *Refusal, 2)
	for range 2 {
		go func() { _, ref := a.Admit(context.Background(), "a", "r", 0); refs <- ref }()
	}
	synctest.Wait()
	if _, ref := a.Admit(context.Background(), "a", "r", 0); ref == nil || ref.Reason != ReasonQueueFull {
		t.Fatalf("third: %+v", ref)
	}
	for range 2 {
		ref := <-refs
		if ref == nil || ref.Reason != ReasonTimeout || ref.Queued != 150*time.Millisecond || ref.RetryAfter <= 0 {
			t.Fatalf("queued: %+v", ref)
		}
	}
	if _, q := a.Stats("a"); q != 0 {
		t.Fatalf("queue depth %d after timeouts", q)
	}
}

// A wait longer than max_wait is refused at once rather than queued.
func TestQueueRefusesHopelessWaitAtOnce(t *testing.T) {
	c := newClock()
	a := newAdmitter(t, c, ModeQueue, Tenant{Name: "a", Limits: Limits{RequestsPerSecond: 0.1, Burst: 1}})
	tk, _ := a.Admit(context.Background(), "a", "r", 0)
	tk.Release(0)
	if _, ref := a.Admit(context.Background(), "a", "r", 0); ref == nil || ref.Reason != ReasonRequests || ref.RetryAfter != 10*time.Second {
		t.Fatalf("%+v", ref)
	}
}

func TestPerRouteLimits(t *testing.T) {
	c := newClock()
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "a", Limits: Limits{RequestsPerSecond: 100, Burst: 100},
		Routes: map[string]Limits{"expensive": {MaxConcurrent: 1}}})
	t1, ref := a.Admit(context.Background(), "a", "expensive", 0)
	if ref != nil {
		t.Fatal(ref)
	}
	if _, ref := a.Admit(context.Background(), "a", "expensive", 0); ref == nil || ref.Reason != ReasonConcurrency {
		t.Fatalf("route limit not applied: %+v", ref)
	}
	if tk, ref := a.Admit(context.Background(), "a", "cheap", 0); ref != nil {
		t.Fatalf("other route limited: %+v", ref)
	} else {
		tk.Release(0)
	}
	t1.Release(0)
}

func TestIdentify(t *testing.T) {
	sum := sha256.Sum256([]byte("sk-hashed"))
	a := newAdmitter(t, nil, ModeReject,
		Tenant{Name: "plain", Keys: []string{"sk-plain"}},
		Tenant{Name: "hashed", KeySHA256: []string{strings.ToUpper(hex.EncodeToString(sum[:]))}})
	for key, want := range map[string]string{"sk-plain": "plain", "sk-hashed": "hashed", "sk-other": ""} {
		if got, _ := a.Identify([]byte(key)); got != want {
			t.Errorf("%s: %q", key, got)
		}
	}
	if n := testing.AllocsPerRun(100, func() { a.Identify([]byte("sk-hashed")) }); n != 0 {
		t.Errorf("Identify allocates %v", n)
	}
}

// Idle state is dropped only once it has refilled, so a tenant that spent
// its burst cannot get a new one by going idle.
func TestEvictionNeverGrantsAnEarlyBurst(t *testing.T) {
	c := newClock()
	cfg := Config{Tenants: []Tenant{{Name: "a", Limits: Limits{RequestsPerSecond: 0.01, Burst: 5}}}, Mode: ModeReject, IdleTTL: time.Minute}
	a := New(cfg, c.now, nil)
	defer a.Close()
	for range 5 {
		tk, _ := a.Admit(context.Background(), "a", "r", 0)
		tk.Release(0)
	}
	c.add(2 * time.Minute) // idle for more than the TTL, but 1.2 of 5 requests refilled
	if n := a.Evict(); n != 0 || a.Tracked() != 1 {
		t.Fatalf("evicted an over-limit tenant (%d)", n)
	}
	admitted := 0
	for range 5 {
		if tk, ref := a.Admit(context.Background(), "a", "r", 0); ref == nil {
			admitted++
			tk.Release(0)
		}
	}
	if admitted != 1 {
		t.Fatalf("admitted %d after idling, want 1 (what refilled)", admitted)
	}
	c.add(10 * time.Minute) // fully refilled and idle
	if n := a.Evict(); n != 1 || a.Tracked() != 0 {
		t.Fatalf("refilled idle tenant not evicted (%d)", n)
	}
}

func TestReloadKeepsStateOfTenants(t *testing.T) {
	c := newClock()
	lim := Limits{RequestsPerSecond: 1, Burst: 2}
	cfg := Config{Tenants: []Tenant{{Name: "same", Limits: lim}, {Name: "changed", Limits: lim}}, Mode: ModeReject}
	a := New(cfg, c.now, nil)
	held, _ := a.Admit(context.Background(), "same", "r", 0)
	for _, name := range []string{"same", "changed"} {
		for range 2 {
			a.Admit(context.Background(), name, "r", 0)
		}
	}
	cfg2 := Config{Tenants: []Tenant{{Name: "same", Limits: lim}, {Name: "changed", Limits: Limits{RequestsPerSecond: 1, Burst: 3}}}, Mode: ModeReject}
	b := New(cfg2, c.now, a)
	defer b.Close()
	if _, ref := b.Admit(context.Background(), "same", "r", 0); ref == nil {
		t.Fatal("unchanged tenant got a fresh burst on reload")
	}
	// A changed tenant keeps its bucket's level under the new burst: the
	// reload is no fresh burst either.
	if _, ref := b.Admit(context.Background(), "changed", "r", 0); ref == nil {
		t.Fatal("changed tenant got a fresh burst on reload")
	}
	c.add(3 * time.Second) // refilled to the new burst of 3
	for i := range 3 {
		if _, ref := b.Admit(context.Background(), "changed", "r", 0); ref != nil {
			t.Fatalf("request %d within the new burst refused: %+v", i, ref)
		}
	}
	held.Release(0)                        // a request admitted before the reload releases into the new one
	if in, _ := b.Stats("same"); in != 1 { // held and one more were in flight
		t.Fatalf("in flight after release: %d", in)
	}
}

// A reload that raises max_concurrent still counts the requests in flight:
// 2 in flight under a limit raised from 2 to 3 leave room for exactly one
// more, and their releases free their slots in the new configuration.
func TestReloadRaisingConcurrencyKeepsRequestsInFlight(t *testing.T) {
	c := newClock()
	cfg := func(n int) Config {
		return Config{Tenants: []Tenant{{Name: "t", Limits: Limits{MaxConcurrent: n},
			Routes: map[string]Limits{"r": {MaxConcurrent: n}}}}, Mode: ModeReject}
	}
	a := New(cfg(2), c.now, nil)
	var held []*Ticket
	for range 2 {
		tk, ref := a.Admit(context.Background(), "t", "r", 0)
		if ref != nil {
			t.Fatal(ref)
		}
		held = append(held, tk)
	}
	b := New(cfg(3), c.now, a)
	defer b.Close()
	if _, ref := b.Admit(context.Background(), "t", "r", 0); ref != nil {
		t.Fatalf("the one slot the raise added was refused: %+v", ref)
	}
	if _, ref := b.Admit(context.Background(), "t", "r", 0); ref == nil {
		t.Fatal("a 4th request was admitted under max_concurrent 3: the reload forgot the requests in flight")
	}
	held[0].Release(0)
	if _, ref := b.Admit(context.Background(), "t", "r", 0); ref != nil {
		t.Fatalf("a slot freed by a request from before the reload stayed taken: %+v", ref)
	}
	if in, _ := b.Stats("t"); in != 3 {
		t.Fatalf("in flight: %d, want 3", in)
	}
}

// Fields left zero take their defaults, and only there (WithDefaults).
func TestConfigDefaults(t *testing.T) {
	c := Config{Tenants: []Tenant{{Name: "a"}}}
	if err := c.Validate(); err != nil {
		t.Fatalf("a config of defaults: %v", err)
	}
	d := c.WithDefaults()
	if d.Mode != ModeReject || d.MaxQueue != 100 || d.MaxWait != 2*time.Second || d.IdleTTL != 10*time.Minute {
		t.Fatalf("defaults: %+v", d)
	}
	set := Config{Mode: ModeQueue, MaxQueue: 7, MaxWait: time.Second, IdleTTL: time.Minute}.WithDefaults()
	if set.Mode != ModeQueue || set.MaxQueue != 7 || set.MaxWait != time.Second || set.IdleTTL != time.Minute {
		t.Fatalf("set fields changed by the defaults: %+v", set)
	}
}

func TestConfigErrorsNameTheField(t *testing.T) {
	f := func(c Config, want string) {
		t.Helper()
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v, want %q", err, want)
		}
	}
	ok := Tenant{Name: "a"}
	f(Config{Mode: ModeReject}, "tenants")
	f(Config{Tenants: []Tenant{ok}, Mode: "drop"}, "admission.mode")
	f(Config{Tenants: []Tenant{ok}, Mode: ModeQueue, MaxQueue: -1}, "admission.max_queue")
	f(Config{Tenants: []Tenant{ok}, Mode: ModeQueue, MaxWait: -time.Second}, "admission.max_wait")
	f(Config{Tenants: []Tenant{ok}, IdleTTL: -time.Second}, "admission.idle_ttl")
	f(Config{Tenants: []Tenant{ok, ok}, Mode: ModeReject}, "tenants[1].name")
	f(Config{Tenants: []Tenant{{Name: "a", Limits: Limits{RequestsPerSecond: -1}}}, Mode: ModeReject}, "tenants[0].requests_per_second")
	f(Config{Tenants: []Tenant{{Name: "a", Limits: Limits{Burst: 3}}}, Mode: ModeReject}, "tenants[0].burst")
	f(Config{Tenants: []Tenant{{Name: "a", KeySHA256: []string{"xyz"}}}, Mode: ModeReject}, "tenants[0].key_sha256[0]")
	f(Config{Tenants: []Tenant{{Name: "a", Keys: []string{"k"}}, {Name: "b", Keys: []string{"k"}}}, Mode: ModeReject}, "tenants[1].keys[0]")
	f(Config{Tenants: []Tenant{ok}, Mode: ModeReject, UnknownKey: "nobody"}, "admission.unknown_key")
	f(Config{Tenants: []Tenant{{Name: "a", Routes: map[string]Limits{"chat": {MaxConcurrent: -1}}}}, Mode: ModeReject}, "tenants[0].routes.chat.max_concurrent")
}
