package stats

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// Three replicas' sketches, through their JSON, merge into the table one
// engine gives for all their requests: the same counts and the same
// quantiles of every measure (a sketch merge adds bucket counts), and the
// verdict on two upstreams is the one over all requests too.
func TestMergeSketchesEqualsOneEngine(t *testing.T) {
	c := newClock()
	all := New(Options{Now: c.now})
	replicas := []*Engine{New(Options{Now: c.now}), New(Options{Now: c.now}), New(Options{Now: c.now})}
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}}, []string{"m"}, metrics.SetOptions{})
	rng := rand.New(rand.NewPCG(31, 32))
	for i := range 3000 {
		row := i % 2
		scale := []float64{1, 1.3}[row] * []float64{1, 2, 4}[i%3] // each replica its own latency
		v := math.Exp(rng.NormFloat64()*0.5+math.Log(100)) * scale
		r := record(set.Series(row, 0), time.Duration(v*float64(time.Millisecond)), time.Duration(5*v*float64(time.Millisecond)), 20)
		r.Class = []string{"in-short.out-short", "in-long.out-short"}[i%5%2]
		if i%17 == 0 {
			r.Outcome = metrics.OutcomeUpstreamError
		}
		all.Observe(r, []time.Duration{time.Duration(v/10) * time.Millisecond})
		replicas[i%3].Observe(r, []time.Duration{time.Duration(v/10) * time.Millisecond})
	}
	c.add(5 * time.Second)
	for _, q := range []Query{{Window: "all"}, {Window: "all", GroupBy: []string{"upstream", "class"}}} {
		var reps []SketchReport
		for _, e := range replicas {
			b, err := json.Marshal(e.QuerySketches(q))
			if err != nil {
				t.Fatal(err)
			}
			var r SketchReport
			if err := json.Unmarshal(b, &r); err != nil {
				t.Fatal(err)
			}
			reps = append(reps, r)
		}
		merged, err := MergeSketches(reps)
		if err != nil {
			t.Fatal(err)
		}
		want := all.Query(q)
		if len(merged.Groups) != len(want.Groups) {
			t.Fatalf("%v: %d merged groups, %d in one engine", q.GroupBy, len(merged.Groups), len(want.Groups))
		}
		for i, g := range merged.Groups {
			w := want.Groups[i]
			if g.key() != w.key() || g.Count != w.Count || g.Errors != w.Errors || g.TTFT != w.TTFT || g.E2E != w.E2E || g.ITL != w.ITL || g.RequestsPerS != w.RequestsPerS {
				t.Errorf("%v group %d:\n merged %+v\n one    %+v", q.GroupBy, i, g, w)
			}
		}
	}
	var reps []SketchReport
	for _, e := range replicas {
		reps = append(reps, e.QuerySketches(Query{Window: "all", Route: "r", GroupBy: []string{"route", "upstream", "class"}}))
	}
	got, err := CompareSketches(reps, "r", "a", "b", "")
	if err != nil {
		t.Fatal(err)
	}
	want, err := all.Compare("r", "a", "b", "all")
	if err != nil {
		t.Fatal(err)
	}
	g, w := find(got, "ttft_ms", "p50"), find(want, "ttft_ms", "p50")
	if g != w || len(got.ByClass) != 2 || got.CountA != want.CountA {
		t.Errorf("merged verdict %+v (%d by class), one engine's %+v", g, len(got.ByClass), w)
	}
}
