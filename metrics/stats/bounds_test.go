package stats

import (
	"runtime"
	"strconv"
	"testing"
	"time"
)

// heapNow is the live heap after two collections (the sketch pool's idle
// states gone too).
func heapNow() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// observeTenant observes one request with every measure and two gaps for
// tenant.
func observeTenant(e *Engine, t *testing.T, tenant string) {
	r := record(series(t), 120*time.Millisecond, time.Second, 30)
	r.Tenant = tenant
	r.Queue, r.Overhead, r.UpstreamTTFB, r.TPOT, r.TTFA = 0, 300*time.Microsecond, 100*time.Millisecond, 30*time.Millisecond, 120*time.Millisecond
	r.ClientTTFT, r.ClientTTFA, r.ClientE2E = 121*time.Millisecond, 121*time.Millisecond, time.Second
	e.Observe(r, []time.Duration{25 * time.Millisecond, 31 * time.Millisecond})
}

// A group that saw one request costs at most groupBytes of heap, then and
// after its slots closed into the minute, the block and all: 4,000
// tenants' one request each, 10,000 reached 1.25 GB when every group held
// 27 aggs of 12 dense sketches from its start.
func TestGroupMemoryBounded(t *testing.T) {
	const n, groupBytes = 1000, 12 << 10
	c := newClock()
	e := New(Options{Now: c.now, MaxGroups: 2 * n})
	h0 := heapNow()
	for i := range n {
		observeTenant(e, t, "t"+strconv.Itoa(i))
	}
	h1 := heapNow()
	c.add(20 * time.Minute)
	e.Query(Query{})
	h2 := heapNow()
	first, later := (h1-h0)/n, (h2-h0)/n
	t.Logf("heap per group: %d B after one request, %d B 20 minutes later", first, later)
	if first > groupBytes || later > groupBytes+4<<10 {
		t.Fatalf("a group of one request holds %d B (%d B later): want at most %d", first, later, groupBytes)
	}
	if got := e.TableStats().Groups; got != n {
		t.Fatalf("%d groups, want %d", got, n)
	}
	runtime.KeepAlive(e)
}

// Past MaxGroups a new key's requests go into its fold group, counted; the
// route's figures still hold every request.
func TestGroupsCapFolds(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now, MaxGroups: 10})
	for i := range 25 {
		observeTenant(e, t, "t"+strconv.Itoa(i))
		observeTenant(e, t, "t"+strconv.Itoa(i))
	}
	ts := e.TableStats()
	if ts.Groups != 11 || ts.Folded != 30 {
		t.Fatalf("%+v, want 10 groups of their own and the fold group, 30 requests folded", ts)
	}
	rep := e.Query(Query{})
	var folded int64
	for _, g := range rep.Groups {
		if g.Tenant == FoldedTenant {
			folded = g.Count
		} else if g.Count != 2 {
			t.Errorf("tenant %s: %d requests, want 2", g.Tenant, g.Count)
		}
	}
	if len(rep.Groups) != 11 || folded != 30 {
		t.Fatalf("%d groups, %d folded requests; want 11 and 30", len(rep.Groups), folded)
	}
	if byRoute := e.Query(Query{GroupBy: []string{"route"}}).Groups; len(byRoute) != 1 || byRoute[0].Count != 50 {
		t.Fatalf("the route: %+v, want its 50 requests", byRoute)
	}
}

// A group idle past IdleGroup is evicted, its all-time figures folded;
// the room it leaves goes to keys that were folded for want of it.
func TestIdleGroupsEvicted(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now, MaxGroups: 5})
	for i := range 8 {
		observeTenant(e, t, "t"+strconv.Itoa(i)) // t5..t7 folded
	}
	c.add(30 * time.Minute)
	observeTenant(e, t, "t0") // t0 stays busy
	c.add(31 * time.Minute)
	e.Query(Query{}) // closes slots: t1..t4 idle past an hour
	ts := e.TableStats()
	if ts.Evicted != 4 || ts.Groups != 2 {
		t.Fatalf("%+v, want 4 evicted, t0 and the fold group left", ts)
	}
	observeTenant(e, t, "t6") // room again: a group of its own
	rep := e.Query(Query{Window: "all"})
	got := map[string]int64{}
	for _, g := range rep.Groups {
		got[g.Tenant] = g.Count
	}
	if got["t0"] != 2 || got["t6"] != 1 || got[FoldedTenant] != 7 || len(got) != 3 {
		t.Fatalf("all-time by tenant %v, want t0 2, t6 1 and the folded 7 (t1..t4, t5..t7)", got)
	}
	if e.TableStats().Folded != 3 {
		t.Fatalf("folded %d requests, want 3", e.TableStats().Folded)
	}
}
