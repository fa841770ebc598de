package stats

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// classSides fills an engine with n requests on each of two upstreams of
// route "r" in two classes: short prompts (TTFT lognormal around 100 ms)
// and long ones (five times slower). Upstream a gets a share longA of
// long prompts, b longB; b's TTFT is scaled by scaleB within each class.
func classSides(rng *rand.Rand, n int, longA, longB, scaleB float64) *Engine {
	c := newClock()
	e := New(Options{Now: c.now})
	set := metrics.NewSet([]metrics.RouteRow{{Route: "r", Upstream: "a"}, {Route: "r", Upstream: "b"}}, nil, metrics.SetOptions{})
	for i := range 2 * n {
		row, long, scale := i%2, longA, 1.0
		if row == 1 {
			long, scale = longB, scaleB
		}
		class, base := "in-short.out-short", 100.0
		if rng.Float64() < long {
			class, base = "in-long.out-short", 500.0
		}
		v := math.Exp(rng.NormFloat64()*0.4+math.Log(base)) * scale
		var r metrics.Record
		r.Reset()
		r.Series, r.Outcome, r.Tenant, r.Class = set.Series(row, 0), metrics.OutcomeOK, "t", class
		r.TTFT, r.E2E, r.OutputTokens = time.Duration(v*float64(time.Millisecond)), time.Duration((4*v+50)*float64(time.Millisecond)), 64
		e.Observe(&r, nil)
	}
	return e
}

// Like with like: two upstreams equal within each class, one given 80%
// long prompts and the other 20%. Pooled, the second looks several times
// faster at the median in every run; compared within classes, the verdict
// as a whole calls nothing outside the noise in at least 90% of runs
// (Holm at 5%), and shows the same mixed figures on both sides. The same
// mix with b 30% slower within every class is found in most runs.
func TestVerdictComparesLikeWithLike(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	const runs = 30
	alarms, pooledSlower := 0, 0
	for range runs {
		e := classSides(rng, 400, 0.8, 0.2, 1)
		c, err := e.Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		if len(c.Classes) != 2 || len(c.ByClass) != 2 {
			t.Fatalf("classes %+v, %d verdicts by class", c.Classes, len(c.ByClass))
		}
		for _, d := range c.Measures {
			if d.Significant {
				alarms++
				break
			}
		}
		ttft := find(c, "ttft_ms", "p50")
		if math.Abs(ttft.RelativeDiff) > 0.25 {
			t.Fatalf("the class-mixed TTFT p50s differ by %v on sides equal within each class: %+v", ttft.RelativeDiff, ttft)
		}
		// What pooling would have said: the same requests as one class.
		pa, pb := pooledTTFT(e, "a"), pooledTTFT(e, "b")
		if pa > 2*pb {
			pooledSlower++
		}
	}
	if alarms > runs/10 {
		t.Errorf("equal within classes, different mixes: %d of %d verdicts called a row outside the noise", alarms, runs)
	}
	if pooledSlower < runs*9/10 {
		t.Errorf("the test does not test: pooled, a's TTFT p50 was over twice b's in only %d of %d runs", pooledSlower, runs)
	}
	found := 0
	for range runs {
		c, err := classSides(rng, 400, 0.8, 0.2, 1.3).Compare("r", "a", "b", "all")
		if err != nil {
			t.Fatal(err)
		}
		if d := find(c, "ttft_ms", "p50"); d.Significant && d.RelativeDiff > 0.1 && d.CILow < 0.3 && d.CIHigh > 0.3 {
			found++
		}
	}
	if found < runs*8/10 {
		t.Errorf("b 30%% slower within every class, mixes opposed: found (interval holding +30%%) in %d of %d runs", found, runs)
	}
}

// pooledTTFT is upstream u's TTFT p50 with its classes pooled.
func pooledTTFT(e *Engine, u string) float64 {
	for _, g := range e.Query(Query{Window: "all", Upstream: u, GroupBy: []string{"upstream"}}).Groups {
		return g.TTFT.P50
	}
	return 0
}

// The stratified test keeps its level: two sides from one distribution
// in two classes (TTFT lognormal around 100 ms and 500 ms), with the same
// mix, at 100 and 1,000 a side: the p50 and p95 rows are called different
// in at most about 5% of runs each.
func TestStrataLevel(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	draw := func(n int, base float64) cdf {
		s := make([]float64, n)
		for i := range s {
			s[i] = math.Exp(rng.NormFloat64()*0.4 + math.Log(base))
		}
		slices.Sort(s)
		return cdfOfSorted(s)
	}
	for _, n := range []int{100, 1000} {
		const runs = 100
		rej := map[float64]int{}
		for range runs {
			st := []stratum{{draw(n/2, 100), draw(n/2, 100)}, {draw(n/2, 500), draw(n/2, 500)}}
			for _, q := range []float64{0.5, 0.95} {
				if r := compareStrata(st, q); !r.tooFew && r.pValue < 0.05 {
					rej[q]++
				}
			}
		}
		for q, k := range rej {
			if k > 11 { // Binomial(100, 5%): above 11 has a chance under 1%
				t.Errorf("n=%d: the stratified p%v test rejected %d of %d at 5%%", n, 100*q, k, runs)
			}
		}
	}
	// And it sees a difference: B 30% slower in both classes, 1,000 a side.
	found := 0
	for range 20 {
		a1, a2 := draw(500, 100), draw(500, 500)
		b1, b2 := draw(500, 130), draw(500, 650)
		if r := compareStrata([]stratum{{a1, b1}, {a2, b2}}, 0.5); r.pValue < 0.05 && r.diff > 0.15 {
			found++
		}
	}
	if found < 18 {
		t.Errorf("30%% slower in both classes found in %d of 20 runs", found)
	}
}
