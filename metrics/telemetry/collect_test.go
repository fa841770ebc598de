package telemetry

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	"go.opentelemetry.io/otel/sdk/resource"
)

// truth is a histogram point counted the slow way: each value against
// each bound, a bucket holding the values above the bound before it and
// up to its own (OTLP's explicit buckets).
type truth struct {
	buckets       []uint64
	count         uint64
	sum, min, max float64
}

func count(bounds, values []float64) truth {
	t := truth{buckets: make([]uint64, len(bounds)+1)}
	for _, v := range values {
		i := 0
		for i < len(bounds) && v > bounds[i] {
			i++
		}
		t.buckets[i]++
		if t.count == 0 || v < t.min {
			t.min = v
		}
		if t.count == 0 || v > t.max {
			t.max = v
		}
		t.count++
		t.sum += v
	}
	return t
}

// find is the named metric of a collection.
func find(t *testing.T, rm *metricdata.ResourceMetrics, name string) (metricdata.Metrics, bool) {
	t.Helper()
	for _, m := range rm.ScopeMetrics[0].Metrics {
		if m.Name == name {
			return m, true
		}
	}
	return metricdata.Metrics{}, false
}

func checkPoint(t *testing.T, what string, got metricdata.HistogramDataPoint[float64], want truth) {
	t.Helper()
	if got.Count != want.count || len(got.BucketCounts) != len(want.buckets) {
		t.Fatalf("%s: count %d in %d buckets, want %d in %d", what, got.Count, len(got.BucketCounts), want.count, len(want.buckets))
	}
	for i := range want.buckets {
		if got.BucketCounts[i] != want.buckets[i] {
			t.Errorf("%s: bucket %d holds %d, want %d", what, i, got.BucketCounts[i], want.buckets[i])
		}
	}
	mn, _ := got.Min.Value()
	mx, _ := got.Max.Value()
	if d := got.Sum - want.sum; d > 1e-9 || d < -1e-9 || mn != want.min || mx != want.max {
		t.Errorf("%s: sum %v min %v max %v, want %v %v %v", what, got.Sum, mn, mx, want.sum, want.min, want.max)
	}
}

// The aggregation against values counted the slow way: token gaps that
// fall on the bounds, between and beyond them, over two export
// intervals, for a cumulative exporter (the second export holds both
// intervals, from the point's start) and a delta one (each interval
// alone, from the export before; a point that did not move is left out).
func TestCollectAgainstKnownTruth(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	gapsOf := func(n int) ([]time.Duration, []float64) {
		var ds []time.Duration
		var vs []float64
		for range n {
			var d time.Duration
			switch rng.IntN(3) {
			case 0: // on a bound
				d = time.Duration(perTokenBuckets[rng.IntN(len(perTokenBuckets))] * float64(time.Second))
			case 1: // anywhere up to past the last bound
				d = time.Duration(rng.Float64() * 3 * float64(time.Second))
			default: // below the first
				d = time.Duration(rng.IntN(10_000_000))
			}
			ds = append(ds, d)
			vs = append(vs, d.Seconds())
		}
		return ds, vs
	}
	rec := func(route string) metrics.Record {
		return metrics.Record{Route: route, Dialect: "openai", Path: "/v1/chat/completions", Stream: true, Outcome: metrics.OutcomeOK,
			Status: 200, E2E: time.Second, ClientE2E: -1, TTFT: 100 * time.Millisecond, ClientTTFT: -1, ServerTTFT: -1,
			TPOT: -1, Queue: -1, Overhead: -1, InputTokens: 10, OutputTokens: 3, TokensSource: "usage", CachedTokens: 4}
	}
	for _, temporality := range []metricdata.Temporality{metricdata.CumulativeTemporality, metricdata.DeltaTemporality} {
		t.Run(temporality.String(), func(t *testing.T) {
			in := newInstruments(SemconvBoth, temporality)
			res := resource.Empty()
			a, b := rec("a"), rec("b")
			gaps1, vals1 := gapsOf(500)
			in.record(&a, "", gaps1)
			in.record(&b, "", gaps1[:7])
			t0 := time.Now()
			first := in.collect(res, scope, t0)
			gaps2, vals2 := gapsOf(300)
			in.record(&a, "", gaps2)
			second := in.collect(res, scope, t0.Add(time.Minute))

			pointOf := func(rm *metricdata.ResourceMetrics, name, route string) (metricdata.HistogramDataPoint[float64], bool) {
				m, ok := find(t, rm, name)
				if !ok {
					return metricdata.HistogramDataPoint[float64]{}, false
				}
				for _, p := range m.Data.(metricdata.Histogram[float64]).DataPoints {
					if v, _ := p.Attributes.Value(attrRoute); v.AsString() == route {
						return p, true
					}
				}
				return metricdata.HistogramDataPoint[float64]{}, false
			}
			for _, name := range []string{"gen_ai.client.operation.time_per_output_chunk", "gen_ai.client.inference.time_per_output_chunk"} {
				p, ok := pointOf(first, name, "a")
				if !ok {
					t.Fatalf("%s: no point for route a", name)
				}
				checkPoint(t, name+" first", p, count(perTokenBuckets, vals1))
				if p.StartTime.After(t0) || !p.Time.Equal(t0) {
					t.Errorf("%s: first point from %v to %v", name, p.StartTime, p.Time)
				}
				pb, _ := pointOf(first, name, "b")
				checkPoint(t, name+" route b", pb, count(perTokenBuckets, vals1[:7]))

				p2, _ := pointOf(second, name, "a")
				_, bMoved := pointOf(second, name, "b")
				if temporality == metricdata.CumulativeTemporality {
					checkPoint(t, name+" second", p2, count(perTokenBuckets, append(append([]float64(nil), vals1...), vals2...)))
					if !p2.StartTime.Equal(p.StartTime) || !bMoved {
						t.Errorf("%s: a cumulative point restarted (%v, then %v) or was left out (b: %v)", name, p.StartTime, p2.StartTime, bMoved)
					}
				} else {
					checkPoint(t, name+" second", p2, count(perTokenBuckets, vals2))
					if !p2.StartTime.Equal(t0) || bMoved {
						t.Errorf("%s: a delta point from %v, want the export before's %v; b, which did not move, exported: %v", name, p2.StartTime, t0, bMoved)
					}
				}
				if m, _ := find(t, second, name); m.Data.(metricdata.Histogram[float64]).Temporality != temporality {
					t.Errorf("%s: temporality %v", name, m.Data.(metricdata.Histogram[float64]).Temporality)
				}
			}
			// The counters: route a's input tokens, 10 a request.
			m, ok := find(t, second, "gen_ai.client.inference.usage.input_tokens")
			if !ok {
				t.Fatal("no input-token counter")
			}
			var got int64
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, _ := p.Attributes.Value(attrRoute); v.AsString() == "a" {
					got = p.Value
				}
			}
			want := int64(20)
			if temporality == metricdata.DeltaTemporality {
				want = 10
			}
			if got != want || !m.Data.(metricdata.Sum[int64]).IsMonotonic {
				t.Errorf("route a's input tokens: %d, want %d, monotonic", got, want)
			}
			// The usage histogram's two token types are two points of one metric.
			u, _ := find(t, first, "gen_ai.client.token.usage")
			types := map[string]float64{}
			for _, p := range u.Data.(metricdata.Histogram[float64]).DataPoints {
				if v, _ := p.Attributes.Value(attrRoute); v.AsString() == "a" {
					tt, _ := p.Attributes.Value(attrTokenType)
					types[tt.AsString()] = p.Sum
				}
			}
			if types["input"] != 10 || types["output"] != 3 || len(types) != 2 {
				t.Errorf("usage points by token type: %v, want input 10 and output 3", types)
			}
		})
	}
}

// Only the mode's names are collected.
func TestCollectModeNames(t *testing.T) {
	for mode, want := range map[string][2]bool{SemconvDefault: {true, false}, SemconvLatest: {false, true}, SemconvBoth: {true, true}} {
		in := newInstruments(mode, metricdata.CumulativeTemporality)
		r := metrics.Record{Route: "r", Outcome: metrics.OutcomeOK, Status: 200, E2E: time.Second, ClientE2E: -1, TTFT: -1, TPOT: -1, InputTokens: 5}
		in.record(&r, "", nil)
		rm := in.collect(resource.Empty(), scope, time.Now())
		_, old := find(t, rm, "gen_ai.client.operation.duration")
		_, latest := find(t, rm, "gen_ai.client.inference.duration")
		_, server := find(t, rm, "gen_ai.server.request.duration")
		if old != want[0] || latest != want[1] || !server {
			t.Errorf("%s: today's names %v, v0.1.0's %v, server's %v; want %v, %v, true", mode, old, latest, server, want[0], want[1])
		}
	}
}
