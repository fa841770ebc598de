package stats

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// TestReadingPerGroup: a group's reading is its streams' known truth: the
// count, the stall rate, the hops' counts and shares exact; the scores'
// quantiles within the sketches' accuracy of the exact ones, their p99
// the low tail; and the same after the sketches of two replicas merge.
// Records without a reading (whole responses) and refusals add nothing.
func TestReadingPerGroup(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	c := newClock()
	all, a, b := New(Options{Now: c.now}), New(Options{Now: c.now}), New(Options{Now: c.now})
	x := series(t)
	var qoes, stalls []float64
	stalled := 0
	held := map[metrics.Hop]int64{}
	for i := range 2000 {
		r := record(x, 100*time.Millisecond, time.Second, 50)
		if i%10 == 9 { // a whole response: no reading
			all.Observe(r, nil)
			a.Observe(r, nil)
			continue
		}
		q := 1.0
		if rng.IntN(4) == 0 {
			q = 0.2 + 0.8*rng.Float64()
		}
		rd := metrics.Reading{Tokens: 50, QoE: q, Fluidity: math.Min(1, q+0.1)}
		if q < 1 {
			rd.Stall = time.Duration(rng.IntN(2000)+1) * time.Millisecond
			rd.Stalls = 1 + rng.IntN(3)
			rd.HeldBy = []metrics.Hop{metrics.HopUpstream, metrics.HopUpstream, metrics.HopGateway, metrics.HopClient}[rng.IntN(4)]
			stalled++
			held[rd.HeldBy]++
		}
		r.Reading = rd
		qoes = append(qoes, q)
		stalls = append(stalls, ms(rd.Stall))
		// Every stream to one engine, and half of them to each replica.
		all.Observe(r, nil)
		[]*Engine{a, b}[len(qoes)%2].Observe(r, nil)
	}
	refused := record(x, metrics.Absent, time.Millisecond, 0)
	refused.Outcome, refused.Attempts = metrics.OutcomeRejected, 0
	refused.Reading = metrics.Reading{Tokens: 5, QoE: 0.01}
	all.Observe(refused, nil)
	a.Observe(refused, nil)

	slices.Sort(qoes)
	slices.Sort(stalls)
	check := func(what string, rep Report) {
		t.Helper()
		if len(rep.Groups) != 1 || rep.Groups[0].Reading == nil {
			t.Fatalf("%s: groups %+v", what, rep.Groups)
		}
		rd := rep.Groups[0].Reading
		if rd.Streams != int64(len(qoes)) || rd.QoE.Count != int64(len(qoes)) {
			t.Errorf("%s: %d streams (%d qoe values), want %d", what, rd.Streams, rd.QoE.Count, len(qoes))
		}
		if want := math.Round(float64(stalled)/float64(len(qoes))*1e4) / 1e4; rd.StallRate != want {
			t.Errorf("%s: stall rate %v, want %v", what, rd.StallRate, want)
		}
		for h, n := range held {
			if rd.HeldBy[h.String()] != n || math.Abs(rd.HeldShare[h.String()]-float64(n)/float64(stalled)) > 1e-4 {
				t.Errorf("%s: held by %s %d (share %v), want %d of %d", what, h, rd.HeldBy[h.String()], rd.HeldShare[h.String()], n, stalled)
			}
		}
		near := func(name string, got, want float64) {
			if math.Abs(got-want) > 0.01*want+0.001 {
				t.Errorf("%s: %s %v, exact %v", what, name, got, want)
			}
		}
		near("qoe p50", rd.QoE.P50, exact(qoes, 0.5))
		near("qoe p95 (the 5th percentile)", rd.QoE.P95, exact(qoes, 0.05))
		near("qoe p99 (the 1st percentile)", rd.QoE.P99, exact(qoes, 0.01))
		near("stall p99", rd.StallMS.P99, exact(stalls, 0.99))
		if rd.QoE.P99 > rd.QoE.P95 || rd.QoE.P95 > rd.QoE.P50 {
			t.Errorf("%s: qoe p50 %v p95 %v p99 %v: the tail must be lower", what, rd.QoE.P50, rd.QoE.P95, rd.QoE.P99)
		}
	}
	check("one engine", all.Query(Query{}))
	// Merged: the two replicas' sketches, as a cluster's /stats merges them.
	reps := []SketchReport{a.QuerySketches(Query{Window: "5m"}), b.QuerySketches(Query{Window: "5m"})}
	raw, err := json.Marshal(reps)
	if err != nil {
		t.Fatal(err)
	}
	var back []SketchReport
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	merged, err := MergeSketches(back)
	if err != nil {
		t.Fatal(err)
	}
	check("merged", merged)
	// A replica's own answer holds its half.
	if rd := a.Query(Query{}).Groups[0].Reading; rd == nil || rd.Streams != int64(len(qoes)/2) {
		t.Errorf("one replica: %+v", rd)
	}
}

// TestHeldWarning: a route whose stalls are mostly held by one hop says
// which and why; a few stalls, or stalls spread over the hops, say
// nothing.
func TestHeldWarning(t *testing.T) {
	x := series(t)
	run := func(stalled int, hops ...metrics.Hop) []Warning {
		c := newClock()
		e := New(Options{Now: c.now})
		for i := range 100 {
			r := record(x, 100*time.Millisecond, time.Second, 20)
			r.Reading = metrics.Reading{Tokens: 20, QoE: 1, Fluidity: 1}
			if i < stalled {
				r.Reading.Stall, r.Reading.Stalls, r.Reading.HeldBy = 300*time.Millisecond, 1, hops[i%len(hops)]
			}
			e.Observe(r, nil)
		}
		var held []Warning
		for _, w := range e.Query(Query{}).Warnings {
			if w.Kind == WarnHeld {
				held = append(held, w)
			}
		}
		return held
	}
	if w := run(31, metrics.HopUpstream); len(w) != 1 || !strings.Contains(w[0].Message, "held by the upstream in 31% of streams") || !strings.Contains(w[0].Message, "bursts") {
		t.Errorf("upstream: %+v", w)
	}
	if w := run(20, metrics.HopClient, metrics.HopClient, metrics.HopClient, metrics.HopUpstream); len(w) != 1 || !strings.Contains(w[0].Message, "held by the client in 15% of streams") || !strings.Contains(w[0].Message, "slow readers") {
		t.Errorf("clients: %+v", w)
	}
	if w := run(3, metrics.HopUpstream); len(w) != 0 {
		t.Errorf("3%% stalled: %+v", w)
	}
	if w := run(30, metrics.HopUpstream, metrics.HopClient); len(w) != 0 {
		t.Errorf("stalls spread over two hops: %+v", w)
	}
}

// qoeSides fills an engine with n streams on each of upstreams a and b of
// route "r": a stream stalls with probability pa (pb on b), its QoE then
// uniform in [lo, 1).
func qoeSides(rng *rand.Rand, n int, pa, pb, lo float64) *Engine {
	c := newClock()
	e := New(Options{Now: c.now})
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}}, nil, metrics.SetOptions{})
	for i := range 2 * n {
		row := i % 2
		var r metrics.Record
		r.Reset()
		r.Series, r.Outcome, r.Tenant = set.Series(row, 0), metrics.OutcomeOK, "t"
		r.TTFT, r.E2E, r.OutputTokens = 100*time.Millisecond, time.Second, 20
		q := 1.0
		if rng.Float64() < []float64{pa, pb}[row] {
			q = lo + (1-lo)*rng.Float64()
		}
		r.Reading = metrics.Reading{Tokens: 20, QoE: q, Fluidity: q}
		e.Observe(&r, nil)
	}
	return e
}

// TestVerdictWeighsQoE: QoE is a row of the verdict, tested as the times
// are: B's streams stalling three times as often is found in its low
// tail, with A the better; equal sides are within noise in most runs.
func TestVerdictWeighsQoE(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	found := 0
	const runs = 20
	for range runs {
		c, err := qoeSides(rng, 600, 0.1, 0.3, 0.3).Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		d := find(c, "qoe", "p95")
		if d.Significant && d.Better == "a" && d.RelativeDiff < 0 {
			found++
		}
	}
	if found < runs*8/10 {
		t.Errorf("B's QoE low tail found worse in %d of %d runs", found, runs)
	}
	alarms := 0
	for range runs {
		c, err := qoeSides(rng, 600, 0.2, 0.2, 0.3).Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range []string{"p50", "p95", "p99"} {
			if find(c, "qoe", q).Significant {
				alarms++
			}
		}
	}
	if alarms > 3 {
		t.Errorf("%d false alarms on QoE in %d runs of equal sides", alarms, runs)
	}
	t.Logf("found in %d of %d runs; %d false alarms in %d equal runs", found, runs, alarms, runs)
}
