package stats

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// sides fills an engine with n requests on each of two upstreams of route
// "r", TTFT lognormal around 200 ms, B's scaled by scaleB.
func sides(rng *rand.Rand, n int, scaleB float64) *Engine {
	c := newClock()
	e := New(Options{Now: c.now})
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}}, nil, metrics.SetOptions{})
	for i := range 2 * n {
		row, scale := i%2, 1.0
		if row == 1 {
			scale = scaleB
		}
		v := math.Exp(rng.NormFloat64()*0.4+math.Log(200)) * scale
		var r metrics.Record
		r.Reset()
		r.Series, r.Outcome, r.Tenant = set.Series(row, 0), metrics.OutcomeOK, "t"
		r.TTFT, r.E2E, r.OutputTokens = time.Duration(v*float64(time.Millisecond)), time.Duration(4*v*float64(time.Millisecond)), 64
		e.Observe(&r, nil)
	}
	return e
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
		c, err := e.Compare("r", "a", "b", "all", uint64(i))
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
	for i := range runs {
		c, err := sides(rng, 400, 1).Compare("r", "a", "b", "all", uint64(i))
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
	if _, err := e.Compare("r", "a", "nope", "all", 0); err != ErrNoSuchUpstream {
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
	d, lo, hi, sig := QuantileDiff(draw(800, 1), draw(800, 1.1), 0.5, 1)
	if !sig || d < 0.03 || lo > 0.1 || hi < 0.1 {
		t.Errorf("10%% shift: %v [%v, %v] %v", d, lo, hi, sig)
	}
	if _, lo, hi, sig := QuantileDiff(draw(800, 1), draw(800, 1), 0.5, 2); sig {
		t.Errorf("equal samples called different: [%v, %v]", lo, hi)
	}
}
