package main

import (
	"math"
	"math/rand/v2"
	"slices"

	"github.com/tokentap/tokentap/metrics/stats"
)

// The gaps between tokens of one request are not independent of each
// other: a request on a busy batch has all its gaps long. A test that
// takes every gap as a sample of its own counts a request of 50 gaps as 50
// witnesses, and calls differences that one slow request makes: on two
// equal runs whose requests each have a speed of their own it found a
// difference far more often than its 5% (TestClusteredGapsFalseAlarms).
// clusterQuantileDiff resamples by request instead.

// bootstrapRounds is how many times each side's requests are drawn again.
const bootstrapRounds = 400

// minClusters is the fewest requests a side needs for a row on its gaps.
const minClusters = 10

// quantileSorted is the value of rank floor(q·(n−1)) of sorted s (the rank
// the live verdict and stats.QuantileDiff read).
func quantileSorted(s []float64, q float64) float64 {
	return s[int(math.Floor(q*float64(len(s)-1)))]
}

// quantileOf is the q-quantile of xs (a sorted copy).
func quantileOf(xs []float64, q float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return quantileSorted(s, q)
}

// pooledQuantile is the q-quantile of every gap of the requests of idx in
// a, sorted in buf.
func pooledQuantile(a [][]float64, idx []int, q float64, buf []float64) ([]float64, float64) {
	buf = buf[:0]
	for _, i := range idx {
		buf = append(buf, a[i]...)
	}
	slices.Sort(buf)
	return buf, quantileSorted(buf, q)
}

// clusterQuantileDiff compares the q-quantiles of the gaps of two sets of
// requests (each a request's gaps): the relative difference (b − a) / a
// over every gap, its 95% interval and a two-sided p-value from a
// bootstrap that draws each side's requests again, with replacement,
// whole (the percentile interval of the ratio; the p-value twice the
// share of draws on the far side of no change). tooFew: a side has fewer
// than minClusters requests or fewer gaps than the quantile takes.
func clusterQuantileDiff(a, b [][]float64, q float64, rng *rand.Rand) (diff, lo, hi, p float64, tooFew bool) {
	count := func(s [][]float64) (n int) {
		for _, g := range s {
			n += len(g)
		}
		return n
	}
	need := int(stats.Needed(q))
	if len(a) < minClusters || len(b) < minClusters || count(a) < need || count(b) < need {
		return 0, 0, 0, 1, true
	}
	all := func(s [][]float64) []int {
		idx := make([]int, len(s))
		for i := range idx {
			idx[i] = i
		}
		return idx
	}
	var bufA, bufB []float64
	bufA, qa := pooledQuantile(a, all(a), q, bufA)
	bufB, qb := pooledQuantile(b, all(b), q, bufB)
	if qa <= 0 || qb <= 0 {
		return 0, 0, 0, 1, true
	}
	diff = qb/qa - 1
	ratios := make([]float64, bootstrapRounds)
	ia, ib := make([]int, len(a)), make([]int, len(b))
	for r := range ratios {
		for i := range ia {
			ia[i] = rng.IntN(len(a))
		}
		for i := range ib {
			ib[i] = rng.IntN(len(b))
		}
		var x, y float64
		bufA, x = pooledQuantile(a, ia, q, bufA)
		bufB, y = pooledQuantile(b, ib, q, bufB)
		ratios[r] = y / max(x, math.SmallestNonzeroFloat64)
	}
	slices.Sort(ratios)
	lo = quantileSorted(ratios, 0.025) - 1
	hi = quantileSorted(ratios, 0.975) - 1
	below := 0
	for _, v := range ratios {
		if v <= 1 {
			below++
		}
	}
	share := float64(min(below, bootstrapRounds-below)+1) / float64(bootstrapRounds+1)
	return diff, min(lo, diff), max(hi, diff), min(1, 2*share), false
}
