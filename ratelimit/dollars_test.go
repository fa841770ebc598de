package ratelimit

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// A tenant with $0.012 a day sending requests estimated at $0.00375 gets
// three through (a fourth would pass the budget) and then a refusal naming
// the day's budget, due when the UTC day ends; a request that cost less
// than reserved gives the rest back.
func TestDollarsPerDay(t *testing.T) {
	c := newClock()
	c.t = time.Date(2026, 12, 5, 23, 0, 0, 0, time.UTC)
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "t", Limits: Limits{USDPerDay: 0.012}})
	var tickets []*Ticket
	for i := range 3 {
		tk, ref := a.AdmitUSD(context.Background(), "t", "chat", 100, 0.00375)
		if ref != nil {
			t.Fatalf("request %d refused: %s", i, ref.Reason)
		}
		tickets = append(tickets, tk)
	}
	_, ref := a.AdmitUSD(context.Background(), "t", "chat", 100, 0.00375)
	if ref == nil || ref.Reason != ReasonUSDDay || ref.RetryAfter != time.Hour {
		t.Fatalf("the fourth: %+v, want usd_per_day until the day ends (1h)", ref)
	}
	// The first cost $0.0005 in the end: $0.00325 comes back, room for one.
	tickets[0].ReleaseUSD(100, 0.0005)
	if _, ref := a.AdmitUSD(context.Background(), "t", "chat", 100, 0.00375); ref != nil {
		t.Fatalf("after a cheaper request: %s", ref.Reason)
	}
	// A new UTC day starts afresh.
	c.add(time.Hour)
	for i := range 3 {
		if _, ref := a.AdmitUSD(context.Background(), "t", "chat", 100, 0.00375); ref != nil {
			t.Fatalf("next day, request %d refused: %s", i, ref.Reason)
		}
	}
}

// The month's budget runs over UTC calendar months, whatever their length.
func TestDollarsPerMonth(t *testing.T) {
	c := newClock()
	c.t = time.Date(2027, 2, 28, 22, 0, 0, 0, time.UTC)
	a := newAdmitter(t, c, ModeReject, Tenant{Name: "t", Limits: Limits{USDPerMonth: 1}})
	if _, ref := a.AdmitUSD(context.Background(), "t", "chat", 1, 0.9); ref != nil {
		t.Fatal(ref.Reason)
	}
	_, ref := a.AdmitUSD(context.Background(), "t", "chat", 1, 0.2)
	if ref == nil || ref.Reason != ReasonUSDMonth || ref.RetryAfter != 2*time.Hour {
		t.Fatalf("over the month's budget: %+v, want usd_per_month until March (2h)", ref)
	}
	c.add(2 * time.Hour)
	if _, ref := a.AdmitUSD(context.Background(), "t", "chat", 1, 0.2); ref != nil {
		t.Fatalf("in March: %s", ref.Reason)
	}
	m, until := monthOf(time.Date(2026, 12, 31, 23, 59, 0, 0, time.UTC))
	if m != 2026*12+11 || until != time.Minute {
		t.Errorf("monthOf at the year's last minute: %d, %v", m, until)
	}
}

// Three replicas on one Redis share a dollar budget: with many requests at
// once through all three, what they admitted passes the budget by at most
// one request's reservation; the store's clock decides the month alike
// (a month budget shared as well).
func TestDollarsSharedAcrossReplicas(t *testing.T) {
	r := redistest.Start(t)
	store := storeAt(r.Addr, 2*time.Second, FailClosed)
	const budget, each = 0.1, 0.00375
	for k, lim := range []Limits{{USDPerDay: budget}, {USDPerMonth: budget}} {
		st := *store
		st.Redis.KeyPrefix += strconv.Itoa(k) + ":"
		cfg := Config{Tenants: []Tenant{{Name: "t", Limits: lim}}, Store: &st}
		var replicas []*Admitter
		for range 3 {
			a := New(cfg, nil, nil)
			defer a.Close()
			replicas = append(replicas, a)
		}
		var admitted atomic.Int64
		var wg sync.WaitGroup
		for i := range 60 {
			wg.Go(func() {
				if _, ref := replicas[i%3].AdmitUSD(context.Background(), "t", "chat", 10, each); ref == nil {
					admitted.Add(1)
				} else if ref.Reason != ReasonUSDDay && ref.Reason != ReasonUSDMonth {
					t.Errorf("refused for %s", ref.Reason)
				}
			})
		}
		wg.Wait()
		spent := float64(admitted.Load()) * each
		t.Logf("%+v: %d admitted, $%.5f of $%.2f", lim, admitted.Load(), spent, budget)
		if spent > budget+each || float64(admitted.Load()) < budget/each-2 {
			t.Errorf("%+v: %d admitted ($%.5f) against $%.2f: want within one request's reservation", lim, admitted.Load(), spent, budget)
		}
	}
}
