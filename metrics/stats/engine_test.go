package stats

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// clock is a manual clock for the windows.
type clock struct{ t time.Time }

func (c *clock) now() time.Time      { return c.t }
func (c *clock) add(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *clock               { return &clock{t: time.Unix(1_700_000_000, 0)} } // on a slot and minute boundary
func series(t *testing.T) *metrics.Series {
	return metrics.NewSet([]metrics.RouteRow{{Route: "chat"}}, []string{"m"}, metrics.SetOptions{}).Series(0, 0)
}

func record(x *metrics.Series, ttft, e2e time.Duration, tokens int) *metrics.Record {
	var r metrics.Record
	r.Reset()
	r.Route, r.Tenant, r.Series, r.Outcome, r.Status = "chat", "default", x, metrics.OutcomeOK, 200
	r.TTFT, r.E2E, r.OutputTokens = ttft, e2e, tokens
	return &r
}

// exact is the value of rank floor(q·(n−1)) of the sorted samples: the
// rank a DDSketch answers for.
func exact(sorted []float64, q float64) float64 {
	return sorted[int(math.Floor(q*float64(len(sorted)-1)))]
}

// TestQuantilesWithinOnePercent checks every reported quantile against
// the exact one over the same samples, for light and heavy tails, across
// merged groups and windows.
func TestQuantilesWithinOnePercent(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	dists := map[string]func() float64{
		"lognormal":    func() float64 { return math.Exp(rng.NormFloat64()*1.2 + 5) },                    // ms, median ~150
		"pareto a=1.1": func() float64 { return 20 / math.Pow(1-rng.Float64(), 1/1.1) },                  // very heavy tail
		"bimodal":      func() float64 { return []float64{30, 2500}[rng.IntN(2)] * (1 + rng.Float64()) }, // fast and queued
		"uniform µs":   func() float64 { return 0.001 + rng.Float64()*0.5 },
	}
	x := series(t)
	for name, gen := range dists {
		t.Run(name, func(t *testing.T) {
			c := newClock()
			e := New(Options{Now: c.now})
			var ttft, itl []float64
			for i := range 20000 {
				v := gen()
				ttft = append(ttft, v)
				r := record(x, time.Duration(v*float64(time.Millisecond)), time.Duration(2*v*float64(time.Millisecond)), 10)
				r.Tenant = []string{"a", "b", "c"}[i%3] // three groups, merged below by a filter-free route query
				// Gaps: sorted as the proxy gives them, or not.
				gaps := make([]time.Duration, 1+rng.IntN(8))
				for j := range gaps {
					gaps[j] = time.Duration(gen() / 10 * float64(time.Millisecond))
					itl = append(itl, ms(gaps[j]))
				}
				if i%2 == 0 {
					slices.Sort(gaps)
				}
				e.Observe(r, gaps)
				if i%1000 == 999 {
					c.add(7 * time.Second) // samples spread over closed slots and minutes
				}
			}
			// The samples are rounded to whole nanoseconds on the way in.
			for i, v := range ttft {
				ttft[i] = ms(time.Duration(v * float64(time.Millisecond)))
			}
			slices.Sort(ttft)
			merged := newAgg()
			e.mu.RLock()
			for _, g := range e.list {
				g.w.collect(&merged, "all", e.slot.Load())
			}
			e.mu.RUnlock()
			slices.Sort(itl)
			checkDist(t, "ttft", makeDist(&merged.d[mTTFT]), ttft)
			checkDist(t, "itl", makeDist(&merged.d[mITL]), itl)
		})
	}
}

func checkDist(t *testing.T, name string, d Dist, sorted []float64) {
	t.Helper()
	ttft := sorted
	if d.Count != int64(len(ttft)) {
		t.Fatalf("%s: count %d, want %d", name, d.Count, len(ttft))
	}
	for _, c := range []struct {
		q   float64
		got float64
	}{{0.5, d.P50}, {0.9, d.P90}, {0.95, d.P95}, {0.99, d.P99}} {
		want := exact(ttft, c.q)
		if rel := math.Abs(c.got-want) / want; rel > 0.01 {
			t.Errorf("%s: p%v = %v, exact %v: relative error %.4f > 1%%", name, c.q*100, c.got, want, rel)
		}
	}
	if want := ttft[len(ttft)-1]; math.Abs(d.Max-want) > 0.001 {
		t.Errorf("%s: max %v, want %v", name, d.Max, want)
	}
	var sum float64
	for _, v := range ttft {
		sum += v
	}
	if want := sum / float64(len(ttft)); math.Abs(d.Mean-want) > 0.0005 { // rounded to µs
		t.Errorf("%s: mean %v, want %v", name, d.Mean, want)
	}
}

// TestWindowsSlide puts requests at known times and checks what each
// window holds as the clock moves on.
func TestWindowsSlide(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	x := series(t)
	obs := func(n int, ttft time.Duration) {
		for range n {
			e.Observe(record(x, ttft, 2*ttft, 5), nil)
		}
	}
	count := func(w string) int64 {
		rep := e.Query(Query{Window: w})
		if len(rep.Groups) == 0 {
			return 0
		}
		return rep.Groups[0].Count
	}
	obs(10, 100*time.Millisecond) // t=0
	c.add(30 * time.Second)
	obs(5, 200*time.Millisecond) // t=30s
	for _, w := range []string{"1m", "5m", "1h", "all"} {
		if got := count(w); got != 15 {
			t.Errorf("t=30s %s: %d requests, want 15", w, got)
		}
	}
	c.add(45 * time.Second) // t=75s: the first ten are older than 1m's 50–60 s
	if got := count("1m"); got != 5 {
		t.Errorf("t=75s 1m: %d, want 5", got)
	}
	if got := count("5m"); got != 15 {
		t.Errorf("t=75s 5m: %d, want 15", got)
	}
	if got := count("15m"); got != 15 {
		t.Errorf("t=75s 15m: %d, want 15", got)
	}
	c.add(5 * time.Minute) // t=6m15s
	if got := count("1m"); got != 0 {
		t.Errorf("t=6m15s 1m: %d, want 0", got)
	}
	if got := count("5m"); got != 0 {
		t.Errorf("t=6m15s 5m: %d, want 0", got)
	}
	if got := count("1h"); got != 15 {
		t.Errorf("t=6m15s 1h: %d, want 15", got)
	}
	c.add(15 * time.Minute) // t=21m15s: the 15m window (10–15 min back) has let them go
	if got := count("15m"); got != 0 {
		t.Errorf("t=21m15s 15m: %d, want 0", got)
	}
	if got := count("1h"); got != 15 {
		t.Errorf("t=21m15s 1h: %d, want 15", got)
	}
	c.add(2 * time.Hour) // a long silence
	obs(1, 300*time.Millisecond)
	if got := count("1h"); got != 1 {
		t.Errorf("after 2h 1h: %d, want 1", got)
	}
	// Idle past IdleGroup, the group was evicted: its all-time figures went
	// into the route's folded group, the new request into a group anew.
	rep := e.Query(Query{Window: "all", GroupBy: []string{"route"}})
	g := rep.Groups[0]
	if g.Count != 16 || g.TTFT.Max != 300 {
		t.Errorf("all: count %d max %v, want 16 and 300", g.Count, g.TTFT.Max)
	}
	if byTenant := e.Query(Query{Window: "all"}).Groups; len(byTenant) != 2 || byTenant[0].Tenant != FoldedTenant ||
		byTenant[0].Count != 15 || byTenant[1].Count != 1 {
		t.Errorf("all by tenant: %+v, want the folded 15 and the new 1", byTenant)
	}
	// requests/s over all: 16 requests since start.
	if want := 16 / rep.WindowS; math.Abs(g.RequestsPerS-want) > 0.001 {
		t.Errorf("requests/s %v, want %v", g.RequestsPerS, want)
	}
	// The timeline has the two slots with traffic an hour ago gone and the
	// open slot with one request.
	tl := e.Timeline("chat")
	pts := tl.Routes[0].Points
	if last := pts[len(pts)-1]; last.Count != 1 || last.TTFTP50 != 300 {
		t.Errorf("open point %+v", last)
	}
	if len(pts) != timelineLen {
		t.Errorf("%d points, want %d", len(pts), timelineLen)
	}
}

// TestTimelinePoints checks the points of closed slots.
func TestTimelinePoints(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	x := series(t)
	for i := range 3 {
		for range 10 {
			e.Observe(record(x, time.Duration(i+1)*100*time.Millisecond, time.Second, 50), nil)
		}
		c.add(10 * time.Second)
	}
	pts := e.Timeline("").Routes[0].Points
	if len(pts) != 4 {
		t.Fatalf("%d points, want 3 closed and the open one", len(pts))
	}
	for i := range 3 {
		p := pts[i]
		if p.Count != 10 || p.TTFTP50 != float64(i+1)*100 || p.OutputTokensPerS != 50 {
			t.Errorf("point %d: %+v", i, p)
		}
	}
}

// TestUpstreamTimelines: a route with two upstreams has, on request, a
// timeline per upstream beside the route's, each with its own requests;
// a route with one has none.
func TestUpstreamTimelines(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}, {Route: "solo"}}, nil, metrics.SetOptions{})
	for i := range 2 {
		for range 10 {
			ra := record(set.Series(0, 0), 100*time.Millisecond, time.Second, 5)
			rb := record(set.Series(1, 0), 300*time.Millisecond, time.Second, 5)
			rs := record(set.Series(2, 0), 50*time.Millisecond, time.Second, 5)
			e.Observe(ra, nil)
			e.Observe(rb, nil)
			if i == 0 {
				e.Observe(rs, nil)
			}
		}
		c.add(10 * time.Second)
	}
	if rt := e.Timeline("r").Routes[0]; len(rt.Upstreams) != 0 {
		t.Fatalf("upstreams without asking: %+v", rt.Upstreams)
	}
	rep := e.TimelineOf("", true)
	for _, rt := range rep.Routes {
		switch rt.Route {
		case "solo":
			if len(rt.Upstreams) != 0 {
				t.Errorf("a route with one upstream has upstream timelines: %+v", rt.Upstreams)
			}
		case "r":
			if len(rt.Upstreams) != 2 || rt.Upstreams[0].Upstream != "a" || rt.Upstreams[1].Upstream != "b" {
				t.Fatalf("upstreams %+v", rt.Upstreams)
			}
			for i, want := range []float64{100, 300} {
				pts := rt.Upstreams[i].Points
				if len(pts) != 3 || pts[0].Count != 10 || pts[1].Count != 10 || pts[0].TTFTP50 != want || !pts[2].Partial {
					t.Errorf("upstream %s: %+v", rt.Upstreams[i].Upstream, pts)
				}
			}
			if rt.Points[0].Count != 20 {
				t.Errorf("the route's point holds %d requests, want 20", rt.Points[0].Count)
			}
		}
	}
}

// TestGoodputAndErrors: judged, good, missed per SLO and errors.
func TestGoodputAndErrors(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	x := series(t)
	slo := metrics.SLO{TTFT: 200 * time.Millisecond, E2E: time.Second, Target: 0.9}
	for i := range 10 {
		r := record(x, time.Duration(100+50*i)*time.Millisecond, 500*time.Millisecond, 5)
		if i == 9 {
			r.Outcome, r.Status = metrics.OutcomeUpstreamError, 502
		}
		slo.Judge(r)
		e.Observe(r, nil)
	}
	g := e.Query(Query{}).Groups[0]
	// ttft 100,150,200 ok; 250…550 miss; the last also failed.
	if g.Goodput.Judged != 10 || g.Goodput.Good != 3 || *g.Goodput.Ratio != 0.3 || *g.Goodput.Target != 0.9 {
		t.Errorf("goodput %+v", g.Goodput)
	}
	if g.Goodput.Missed["ttft"] != 7 || g.Goodput.Missed["failed"] != 1 || g.Goodput.Missed["e2e"] != 0 {
		t.Errorf("missed %v", g.Goodput.Missed)
	}
	if g.Errors != 1 {
		t.Errorf("errors %d, want 1", g.Errors)
	}
}

func TestObserveAllocsNothing(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	x := series(t)
	r := record(x, 120*time.Millisecond, time.Second, 30)
	r.Queue, r.Overhead, r.UpstreamTTFB, r.TPOT, r.TTFA = 0, 300*time.Microsecond, 100*time.Millisecond, 30*time.Millisecond, 120*time.Millisecond
	gaps := make([]time.Duration, 29)
	for i := range gaps {
		gaps[i] = time.Duration(25+i) * time.Millisecond
	}
	for range 100 { // the sketches take their bins
		e.Observe(r, gaps)
	}
	if n := testing.AllocsPerRun(1000, func() { e.Observe(r, gaps) }); n != 0 {
		t.Errorf("%v allocations per Observe, want 0", n)
	}
}

// BenchmarkObserve is the per-request cost on the relay's side: one
// finished record with every measure set, without and with its 29 gaps.
func BenchmarkObserve(b *testing.B) {
	for _, n := range []int{0, 29} {
		b.Run(map[int]string{0: "record", 29: "record+29gaps"}[n], func(b *testing.B) {
			e := New(Options{})
			x := metrics.NewSet([]metrics.RouteRow{{Route: "chat"}}, []string{"m"}, metrics.SetOptions{}).Series(0, 0)
			r := record(x, 120*time.Millisecond, time.Second, 30)
			r.Queue, r.Overhead, r.UpstreamTTFB, r.TPOT, r.TTFA = 0, 300*time.Microsecond, 100*time.Millisecond, 30*time.Millisecond, 120*time.Millisecond
			gaps := make([]time.Duration, n)
			for i := range gaps {
				gaps[i] = time.Duration(25+i) * time.Millisecond
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				e.Observe(r, gaps)
			}
		})
	}
}
