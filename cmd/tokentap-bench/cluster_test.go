package main

import (
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// clusteredRun is n requests of gaps tokens each: a request has a speed
// of its own (lognormal, spread 0.4) and each gap varies around it (0.1),
// as requests on batches of different sizes do; scale multiplies every
// gap.
func clusteredRun(rng *rand.Rand, n, gaps int, scale float64) [][]float64 {
	out := make([][]float64, n)
	for i := range out {
		speed := math.Exp(rng.NormFloat64()*0.4+math.Log(20)) * scale
		for range gaps {
			out[i] = append(out[i], speed*math.Exp(rng.NormFloat64()*0.1))
		}
	}
	return out
}

// Statistics are code: on two equal runs whose requests each have a speed
// of their own, taking every gap as independent calls the ITL p50
// different in far more than 5% of runs (a run of 60 requests is 60
// witnesses, not 1,200); resampling by request stays near 5%; and a true
// 40% difference is still found.
func TestClusteredGapsFalseAlarms(t *testing.T) {
	wait.Long(t, "thousands of simulated runs")
	rng := rand.New(rand.NewPCG(5, 6))
	const runs, n, gaps = 30, 60, 20
	independent, clustered, found := 0, 0, 0
	for range runs {
		a, b := clusteredRun(rng, n, gaps, 1), clusteredRun(rng, n, gaps, 1)
		var fa, fb []float64
		for i := range a {
			fa, fb = append(fa, a[i]...), append(fb, b[i]...)
		}
		if _, _, _, p, _ := stats.QuantileDiff(fa, fb, 0.5); p < 0.05 {
			independent++
		}
		if _, _, _, p, tooFew := clusterQuantileDiff(a, b, 0.5, rng); !tooFew && p < 0.05 {
			clustered++
		}
		slower := clusteredRun(rng, n, gaps, 1.4)
		if _, lo, _, p, _ := clusterQuantileDiff(a, slower, 0.5, rng); p < 0.05 && lo > 0 {
			found++
		}
	}
	t.Logf("equal runs called different: gaps as independent %d of %d, by request %d; a 40%% difference found %d of %d",
		independent, runs, clustered, found, runs)
	if clustered > runs/6 {
		t.Errorf("resampled by request, %d of %d equal runs called different (want about 5%%)", clustered, runs)
	}
	if independent < runs/4 {
		t.Errorf("gaps as independent called only %d of %d equal runs different: the test's clustering is too weak to tell", independent, runs)
	}
	if found < runs*3/4 {
		t.Errorf("a 40%% difference found in %d of %d runs", found, runs)
	}
}

// A run longer than maxSamples that drifts (its first half fast, its
// second slow) is kept as a random sample of the whole: compare's change
// is the change of the data its interval is drawn from, and lies within
// it. Kept in order, the first 20,000 held only the fast half, and the
// change of every sample fell outside their interval.
func TestCompareChangeWithinItsInterval(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	file := func(name string, slowSecondHalf float64) string {
		res := make([]result, 3*maxSamples)
		for i := range res {
			v := math.Exp(rng.NormFloat64()*0.2 + math.Log(100))
			if i >= len(res)/2 {
				v *= slowSecondHalf
			}
			d := time.Duration(v * float64(time.Millisecond))
			res[i] = result{Status: 200, TTFT: d, E2E: 4 * d, Output: 10,
				Tokens: []time.Duration{d, d + 20*time.Millisecond, d + 41*time.Millisecond}}
		}
		s := summarize("run", res, time.Minute, 0, slo{})
		p := filepath.Join(t.TempDir(), name+".json")
		b, _ := json.Marshal(map[string]any{"summary": s})
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	var out strings.Builder
	if err := runCompare([]string{file("before", 1), file("after", 1.5)}, &out); err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile(`TTFT p50 ms\s+\S+\s+\S+\s+([+-][0-9.]+)%\s+([+-][0-9.]+)% … ([+-][0-9.]+)%`)
	m := row.FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no TTFT p50 row:\n%s", out.String())
	}
	change, _ := strconv.ParseFloat(m[1], 64)
	lo, _ := strconv.ParseFloat(m[2], 64)
	hi, _ := strconv.ParseFloat(m[3], 64)
	if change < lo || change > hi {
		t.Fatalf("a change of %+.1f%% outside its interval %+.1f%% … %+.1f%%:\n%s", change, lo, hi, out.String())
	}
	// The whole run's change, about +22% (the median moves by half of
	// the slower half's 50%), and not the first half's 0%.
	if change < 10 || change > 35 {
		t.Fatalf("change %+.1f%%: the sample is not of the whole run\n%s", change, out.String())
	}
}
