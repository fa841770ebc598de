package stats

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// sides fills an engine with n requests on each of two upstreams of route
// "r", TTFT lognormal around 200 ms, B's scaled by scaleB, E2E four times
// TTFT (sidesFrom).
func sides(rng *rand.Rand, n int, scaleB float64) *Engine {
	return sidesFrom(rng, n, scaleB, func(r *rand.Rand) float64 { return math.Exp(r.NormFloat64()*0.4 + math.Log(200)) },
		func(_ *rand.Rand, v float64) float64 { return 4 * v })
}

func find(c Comparison, name, q string) Diff {
	for _, d := range c.Measures {
		if d.Name == name && d.Quantile == q {
			return d
		}
	}
	return Diff{}
}

// TestVerdictFindsATenPercentDifference: B's TTFT 10% higher, 600
// requests a side: the p50 difference is found, its interval covers 10%,
// and throughput per request (tokens / E2E) reads about −9%.
func TestVerdictFindsATenPercentDifference(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	found := 0
	const runs = 40
	for i := range runs {
		e := sides(rng, 600, 1.10)
		c, err := e.Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		d := find(c, "ttft_ms", "p50")
		if d.Significant && d.RelativeDiff > 0 {
			found++
		}
		if i == 0 {
			if d.CILow > 0.10 || d.CIHigh < 0.10 || c.CountA != 600 || c.CountB != 600 {
				t.Errorf("p50 %+v", d)
			}
			if tp := c.Through; tp.RelativeDiff > -0.05 || tp.RelativeDiff < -0.13 {
				t.Errorf("throughput %+v", tp)
			}
		}
	}
	if found < runs*8/10 {
		t.Errorf("a 10%% TTFT p50 difference found significant in %d of %d runs", found, runs)
	}
	t.Logf("10%% difference found in %d of %d runs (600 requests a side)", found, runs)
}

// TestVerdictEqualSidesWithinNoise: two samples of the same distribution
// are called within noise in most runs; the false-alarm rate of each
// quantile stays near the 5% a 95% interval allows.
func TestVerdictEqualSidesWithinNoise(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const runs = 100
	alarms := map[string]int{}
	for range runs {
		c, err := sides(rng, 400, 1).Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range []string{"p50", "p95", "p99"} {
			if find(c, "ttft_ms", q).Significant {
				alarms[q]++
			}
		}
	}
	for q, n := range alarms {
		if n > 12 {
			t.Errorf("TTFT %s: %d false alarms in %d runs of equal sides", q, n, runs)
		}
	}
	t.Logf("false alarms in %d runs of equal sides (400 a side): %v", runs, alarms)
}

func TestCompareNeedsBothSides(t *testing.T) {
	e := sides(rand.New(rand.NewPCG(1, 1)), 10, 1)
	if _, err := e.Compare("r", "a", "nope", "all"); err != ErrNoSuchUpstream {
		t.Errorf("err %v", err)
	}
}

// TestQuantileDiffOnSamples: the offline form finds a 10% shift and
// calls two draws of one distribution alike.
func TestQuantileDiffOnSamples(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	draw := func(n int, scale float64) []float64 {
		s := make([]float64, n)
		for i := range s {
			s[i] = math.Exp(rng.NormFloat64()*0.4+math.Log(200)) * scale
		}
		return s
	}
	d, lo, hi, p, few := QuantileDiff(draw(800, 1), draw(800, 1.1), 0.5)
	if few || p > 0.05 || d < 0.03 || lo > 0.1 || hi < 0.1 {
		t.Errorf("10%% shift: %v [%v, %v] p %v", d, lo, hi, p)
	}
	if _, lo, hi, p, _ := QuantileDiff(draw(800, 1), draw(800, 1), 0.5); p <= 0.05 {
		t.Errorf("equal samples called different: [%v, %v] p %v", lo, hi, p)
	}
}

// sidesFrom fills an engine with n requests on each of two upstreams of
// route "r": TTFT drawn by draw (B's scaled by scaleB), E2E from it by e2e,
// 64 output tokens.
func sidesFrom(rng *rand.Rand, n int, scaleB float64, draw func(*rand.Rand) float64, e2e func(*rand.Rand, float64) float64) *Engine {
	c := newClock()
	e := New(Options{Now: c.now})
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}}, nil, metrics.SetOptions{})
	for i := range 2 * n {
		row, scale := i%2, 1.0
		if row == 1 {
			scale = scaleB
		}
		v := draw(rng) * scale
		var r metrics.Record
		r.Reset()
		r.Series, r.Outcome, r.Tenant = set.Series(row, 0), metrics.OutcomeOK, "t"
		r.TTFT, r.E2E, r.OutputTokens = time.Duration(v*float64(time.Millisecond)), time.Duration(e2e(rng, v)*float64(time.Millisecond)), 64
		e.Observe(&r, nil)
	}
	return e
}

// plusDraw is an E2E of four times the TTFT plus a draw of its own.
func plusDraw(draw func(*rand.Rand) float64) func(*rand.Rand, float64) float64 {
	return func(r *rand.Rand, v float64) float64 { return 4*v + draw(r) }
}

// The distributions a verdict must stay honest on: lognormal, Pareto
// with a = 1.5 (infinite variance), and a bimodal mixture (a cache that
// hits or misses).
var verdictDists = []struct {
	name string
	draw func(*rand.Rand) float64
}{
	{"lognormal", func(r *rand.Rand) float64 { return math.Exp(r.NormFloat64()*0.6 + math.Log(200)) }},
	{"pareto1.5", func(r *rand.Rand) float64 { return 50 / math.Pow(1-r.Float64(), 1/1.5) }},
	{"bimodal", func(r *rand.Rand) float64 {
		if r.Float64() < 0.7 {
			return 40 + 10*r.NormFloat64()*0.2 + 10
		}
		return 400 * math.Exp(0.3*r.NormFloat64())
	}},
}

// TestVerdictFalseAlarmsAtEverySize: two upstreams fed from one
// distribution, at 5, 20, 100 and 1,000 requests a side. Every row's 95%
// interval, every row's verdict, and the verdict as a whole (any row
// significant), is a false alarm in at
// most the 5% the method promises (seeded runs, so the counts are fixed;
// the bound allows the runs' binomial spread above 5%). Rows whose
// quantile the requests cannot bound say so, with the count they need.
func TestVerdictFalseAlarmsAtEverySize(t *testing.T) {
	long(t, "thousands of simulated verdicts")
	sizes := []struct{ n, runs int }{{5, 100}, {20, 100}, {100, 100}, {1000, 40}}
	for _, d := range verdictDists {
		for _, sz := range sizes {
			rng := rand.New(rand.NewPCG(uint64(sz.n), 11))
			rowAlarms, outside, family, tested := map[string]int{}, map[string]int{}, 0, 0
			for range sz.runs {
				c, err := sidesFrom(rng, sz.n, 1, d.draw, plusDraw(d.draw)).Compare("r", "a", "b", "all")
				if err != nil {
					t.Fatal(err)
				}
				any := false
				for _, m := range append(c.Measures, c.Through) {
					key := m.Name + " " + m.Quantile
					q := map[string]float64{"p50": 0.5, "p95": 0.95, "p99": 0.99}[m.Quantile]
					wantFew := int64(sz.n) < Needed(q)
					if m.TooFew != wantFew || m.TooFew && m.NeedA != Needed(q)-int64(sz.n) {
						t.Fatalf("%s n=%d %s: too_few %v (need %d more), want %v", d.name, sz.n, key, m.TooFew, m.NeedA, wantFew)
					}
					if m.TooFew && m.Significant {
						t.Fatalf("%s n=%d %s: significant with too few requests", d.name, sz.n, key)
					}
					if !m.TooFew {
						tested++
					}
					if m.Significant {
						rowAlarms[key]++
						any = true
					}
					if !m.TooFew && (m.CILow > 0 || m.CIHigh < 0) {
						outside[key]++ // the row's own 95% interval misses the truth (0)
					}
				}
				if any {
					family++
				}
			}
			limit := sz.runs*5/100 + 2*int(math.Sqrt(float64(sz.runs)*0.05)) + 1
			for key, n := range rowAlarms {
				if n > limit {
					t.Errorf("%s, %d a side: %s significant in %d of %d runs of equal sides", d.name, sz.n, key, n, sz.runs)
				}
			}
			for key, n := range outside {
				if n > limit {
					t.Errorf("%s, %d a side: %s interval excluded 0 in %d of %d runs of equal sides", d.name, sz.n, key, n, sz.runs)
				}
			}
			if family > limit {
				t.Errorf("%s, %d a side: a significant row in %d of %d verdicts on equal sides", d.name, sz.n, family, sz.runs)
			}
			t.Logf("%s, %d a side: verdicts with a false alarm %d of %d (%d rows tested)", d.name, sz.n, family, sz.runs, tested)
		}
	}
}

// TestVerdictPower: how often the TTFT p50 row finds a 10% and a 50%
// slower side at 100 and 1,000 requests a side (lognormal), within the
// whole verdict (Holm). A 50% difference is found at 100 a side in most
// runs and at 1,000 in every run; 10% at 1,000 in most.
func TestVerdictPower(t *testing.T) {
	long(t, "hundreds of simulated verdicts")
	for _, c := range []struct {
		n     int
		scale float64
		min   float64 // the least share of runs that must find it
	}{{100, 1.1, 0}, {100, 1.5, 0.8}, {1000, 1.1, 0.6}, {1000, 1.5, 1}} {
		rng := rand.New(rand.NewPCG(uint64(c.n), uint64(c.scale*100)))
		const runs = 30
		found := 0
		for range runs {
			v, err := sidesFrom(rng, c.n, c.scale, verdictDists[0].draw, plusDraw(verdictDists[0].draw)).Compare("r", "a", "b", "all")
			if err != nil {
				t.Fatal(err)
			}
			if d := find(v, "ttft_ms", "p50"); d.Significant && d.RelativeDiff > 0 {
				found++
			}
		}
		share := float64(found) / runs
		if share < c.min {
			t.Errorf("%d a side, TTFT %.0f%% slower: found in %d of %d runs", c.n, 100*(c.scale-1), found, runs)
		}
		t.Logf("power: %d a side, TTFT %+.0f%%: found in %d of %d runs", c.n, 100*(c.scale-1), found, runs)
	}
}

// Two sides far apart (B 2.6 times slower, none of its requests as fast
// as A's slowest) gave intervals of no width ("+164.0% … +164.0%"): every
// interval is at least the sketches' resolution wide, and holds the truth.
// Rows say why they are or are not significant, and a significant row
// which side does better (the lower time).
func TestVerdictIntervalsAndWords(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	e := sidesFrom(rng, 2000, 2.6, func(r *rand.Rand) float64 { return 100 + 10*r.Float64() },
		func(_ *rand.Rand, v float64) float64 { return 4 * v })
	c, err := e.Compare("r", "a", "b", "all")
	if err != nil {
		t.Fatal(err)
	}
	d := find(c, "ttft_ms", "p50")
	if width := d.CIHigh - d.CILow; width < 2*RelativeAccuracy || d.CILow > 1.6 || d.CIHigh < 1.6 {
		t.Fatalf("ttft p50 %+.4f (%+.4f … %+.4f): want an interval at least the sketches' resolution wide, holding +160%%", d.RelativeDiff, d.CILow, d.CIHigh)
	}
	if !d.Significant || d.Better != "a" || !strings.Contains(d.Why, "outside the noise") {
		t.Fatalf("a 2.6 times slower B: significant %v, better %q, why %q", d.Significant, d.Better, d.Why)
	}
	if tp := c.Through; !tp.Significant || tp.Better != "a" {
		t.Fatalf("tokens/s per request of the slower B: better %q (%s)", tp.Better, tp.Why)
	}

	// A row that its own interval calls different and Holm's method does
	// not: it says so.
	rows := []*Diff{{PValue: 0.02, CILow: 0.01, CIHigh: 0.2}, {PValue: 0.5, CILow: -0.1, CIHigh: 0.1}, {PValue: 0.001, CILow: 0.1, CIHigh: 0.3}, {PValue: 0.4}, {PValue: 0.3}}
	judge(rows)
	if rows[0].Significant || !strings.Contains(rows[0].Why, "not significant across 5 rows") || !strings.Contains(rows[1].Why, "holds 0") ||
		!rows[2].Significant || !strings.Contains(rows[2].Why, "outside the noise") {
		t.Fatalf("the words: %q, %q, %q", rows[0].Why, rows[1].Why, rows[2].Why)
	}
}
