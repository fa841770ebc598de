package ratelimit

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// TestReloadsHandInFlightRequestsOver: a tenant of max_concurrent 2 (of
// its own and on its route) with two requests in flight. A reload that
// takes the shared store away, then one that gives it back, then one that
// takes it away again: after each, a third request is refused
// (concurrency), and once one of the two ends, one more is admitted and
// no more. The store's second replica sees the slots as this one counts
// them: freed when the store goes (the other replica may use them), taken
// again as leases when it comes back. Before, each of these reloads let a
// third request run (3 of 2).
func TestReloadsHandInFlightRequestsOver(t *testing.T) {
	r := redistest.Start(t)
	limits := Limits{MaxConcurrent: 2}
	local := Config{Tenants: []Tenant{{Name: "a", Limits: limits, Routes: map[string]Limits{"chat": {MaxConcurrent: 2}}}}}
	shared := local
	shared.Store = &StoreConfig{Redis: RedisConfig{Addr: r.Addr, Timeout: time.Second, KeyPrefix: fmt.Sprintf("handover%d:", time.Now().UnixNano())},
		Fail: FailClosed, LeaseTTL: 3 * time.Second}
	for _, c := range []*Config{&local, &shared} {
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
	}
	other := New(shared, nil, nil) // another replica on the same store
	t.Cleanup(other.Close)
	admit := func(a *Admitter) (*Ticket, *Refusal) { return a.Admit(context.Background(), "a", "chat", 1) }
	mustRefuse := func(a *Admitter, when string) {
		t.Helper()
		if tk, ref := admit(a); ref == nil || ref.Reason != ReasonConcurrency {
			tk.Release(0)
			t.Fatalf("%s: a third request %v, want refused for concurrency", when, ref)
		}
	}

	a := New(shared, nil, nil)
	t1, _ := admit(a)
	t2, ref := admit(a)
	if ref != nil {
		t.Fatalf("second request refused: %s", ref.Reason)
	}
	mustRefuse(a, "with the store")

	a = New(local, nil, a) // the store taken away
	t.Cleanup(a.Close)
	mustRefuse(a, "after the store was taken away")
	settled(t, other)
	o1, ref := admit(other)
	if ref != nil {
		t.Fatalf("the other replica: the slots the reload freed are still taken (%s)", ref.Reason)
	}
	o1.Release(0)
	settled(t, other)

	a = New(shared, nil, a) // and given back
	mustRefuse(a, "after the store came back")
	if tk, ref := admit(other); ref == nil {
		tk.Release(0)
		t.Fatal("the other replica: the two requests in flight hold no lease in the store that came back")
	}

	t1.Release(1)
	t3, ref := admit(a)
	if ref != nil {
		t.Fatalf("after one of the two ended: %s", ref.Reason)
	}
	mustRefuse(a, "with one ended and one admitted after it")

	a = New(local, nil, a) // taken away again, with one moved twice
	mustRefuse(a, "after the store was taken away again")
	t2.Release(1)
	t3.Release(1)
	t4, ref := admit(a)
	t5, ref2 := admit(a)
	if ref != nil || ref2 != nil {
		t.Fatalf("after every request ended: %v %v, want two admitted", ref, ref2)
	}
	mustRefuse(a, "at the end")
	t4.Release(0)
	t5.Release(0)
	if in, _ := a.Stats("a"); in != 0 {
		t.Errorf("%d in flight at the end, want 0", in)
	}
}
