package stats

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/DataDog/sketches-go/ddsketch"
	"github.com/DataDog/sketches-go/ddsketch/store"
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

// Answers no tokentap gives are refused with a message before anything of
// them is merged: a bin index past 2^32 (it panicked sketches-go's dense
// store), negative counts (TTFT printed as -2.6e137), a sketch of
// megabytes (798 MB of RSS for 2.96 MB of JSON), counts that disagree.
func TestMergeSketchesRefusesHostileAnswers(t *testing.T) {
	c := newClock()
	e := New(Options{Now: c.now})
	for range 20 {
		e.Observe(record(series(t), 100*time.Millisecond, time.Second, 10), []time.Duration{20 * time.Millisecond})
	}
	good := e.QuerySketches(Query{Window: "all"})
	encoded := func(f func(st *store.SparseStore)) []byte {
		st := store.NewSparseStore()
		f(st)
		sk := ddsketch.NewDDSketch(valueMapping, st, store.NewSparseStore())
		var b []byte
		sk.Encode(&b, true)
		return b
	}
	hostile := map[string]func(g *SketchGroup){
		"bin index past 2^32": func(g *SketchGroup) {
			g.Measures[mTTFT].Sketch = encoded(func(st *store.SparseStore) { st.AddWithCount(1<<33, float64(g.Measures[mTTFT].N)) })
		},
		"negative bin index far below": func(g *SketchGroup) {
			g.Measures[mTTFT].Sketch = encoded(func(st *store.SparseStore) { st.AddWithCount(-1<<40, float64(g.Measures[mTTFT].N)) })
		},
		"negative count":         func(g *SketchGroup) { g.Count = -5 },
		"negative measure count": func(g *SketchGroup) { g.Measures[mTTFT].N = -1 },
		"more errors than count": func(g *SketchGroup) { g.Errors = g.Count + 1 },
		"infinite sum":           func(g *SketchGroup) { g.Measures[mE2E].Sum = math.Inf(1) },
		"bins that miscount":     func(g *SketchGroup) { g.Measures[mTTFT].N++ },
		"a sketch of 3 MB":       func(g *SketchGroup) { g.Measures[mTTFT].Sketch = make([]byte, 3<<20) },
		"a count without sketch": func(g *SketchGroup) { g.Measures[mTTFT].Sketch = nil },
		"fractional bin count": func(g *SketchGroup) {
			g.Measures[mTTFT].Sketch = encoded(func(st *store.SparseStore) { st.AddWithCount(100, 19.5); st.AddWithCount(101, 0.5) })
		},
		"misses beyond judged":    func(g *SketchGroup) { g.Missed[0] = 1 },
		"goodput target past one": func(g *SketchGroup) { g.Target = 7 },
	}
	for name, spoil := range hostile {
		t.Run(name, func(t *testing.T) {
			b, _ := json.Marshal(good)
			var bad SketchReport
			if err := json.Unmarshal(b, &bad); err != nil {
				t.Fatal(err)
			}
			spoil(&bad.Groups[0])
			var err error
			func() {
				defer func() {
					if r := recover(); r != nil {
						t.Fatalf("merging panicked: %v", r)
					}
				}()
				_, err = MergeSketches([]SketchReport{good, bad})
			}()
			if err == nil {
				t.Fatal("merged without a word")
			}
			t.Log(err)
		})
	}
	if _, err := MergeSketches([]SketchReport{good, good}); err != nil {
		t.Fatalf("two good answers: %v", err)
	}
}
