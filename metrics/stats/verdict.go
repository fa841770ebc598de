package stats

import (
	"cmp"
	"math"
	"slices"
	"sort"
)

// The verdict's statistics.
//
// A row compares the p-quantiles of two sides by the two-sample quantile
// test (Mood's median test, for any quantile): pool both sides, take the
// pooled p-quantile c, and count the requests of side A at or below it.
// Were both sides drawn from one distribution, the requests' sides would
// be exchangeable, and given how many pooled requests lie at or below c
// that count is hypergeometric, whatever the distribution, the counts or
// the ties: the test's p-value is exact at every sample size. The
// interval for (b − a) / a is the set of ratios r for which B's values
// divided by r pass the same test at 5% (the test inverted under a change
// of scale), so it holds its 95% whenever B is A scaled, and excludes 0
// exactly when the row's own test rejects at 5%.
//
// A quantile needs samples on both sides of it: a side with fewer than
// needed(p) requests (7 for a p50, 86 for a p95, 436 for a p99: the count
// at which its own order statistics bound the quantile at 97.5%) makes
// the row "too few requests", with the count still missing, and the row
// is not tested. The rows that are tested are judged together by Holm's
// step-down method at 5%, so that a verdict on two equal upstreams shows
// no significant row in at least 95% of runs.

// verdictAlpha is the level of the verdict as a whole (Holm), and of each
// row's interval.
const verdictAlpha = 0.05

// cdf is one side's samples as a step function: distinct values
// ascending, and how many samples lie at or below each.
type cdf struct {
	vals []float64
	cum  []float64
	n    float64
}

// cdfOfSorted reads sorted samples.
func cdfOfSorted(s []float64) cdf {
	c := cdf{n: float64(len(s))}
	for i, v := range s {
		if k := len(c.vals); k > 0 && c.vals[k-1] == v {
			c.cum[k-1] = float64(i + 1)
			continue
		}
		c.vals, c.cum = append(c.vals, v), append(c.cum, float64(i+1))
	}
	return c
}

// cdfOfDist reads a sketch's bins (each at its representative value, no
// more than the exact maximum).
func cdfOfDist(d *dist) cdf {
	type bin struct{ v, n float64 }
	var bins []bin
	d.forEach(func(v, n float64) bool {
		bins = append(bins, bin{min(v, d.maximum()), n})
		return false
	})
	slices.SortFunc(bins, func(a, b bin) int { return cmp.Compare(a.v, b.v) })
	c := cdf{}
	for _, b := range bins {
		c.n += b.n
		if k := len(c.vals); k > 0 && c.vals[k-1] == b.v {
			c.cum[k-1] = c.n
			continue
		}
		c.vals, c.cum = append(c.vals, b.v), append(c.cum, c.n)
	}
	return c
}

// below is how many samples are below v (values scaled by s).
func (c *cdf) below(v, s float64) float64 {
	i := sort.Search(len(c.vals), func(i int) bool { return c.vals[i]*s >= v })
	if i == 0 {
		return 0
	}
	return c.cum[i-1]
}

// atOrBelow is how many samples are at or below v (values scaled by s).
func (c *cdf) atOrBelow(v, s float64) float64 {
	i := sort.Search(len(c.vals), func(i int) bool { return c.vals[i]*s > v })
	if i == 0 {
		return 0
	}
	return c.cum[i-1]
}

// quantile is the value of rank ⌊p(n − 1)⌋ + 1.
func (c *cdf) quantile(p float64) float64 {
	if c.n == 0 {
		return 0
	}
	r := math.Floor(p*(c.n-1)) + 1
	i := sort.Search(len(c.cum), func(i int) bool { return c.cum[i] >= r })
	return c.vals[min(i, len(c.vals)-1)]
}

// moodP is the two-sided p-value of the quantile test of a against b
// with b's values scaled by s.
func moodP(a, b *cdf, s, p float64) float64 {
	n, _, c := pooledQuantile(a, b, s, p)
	ka := a.atOrBelow(c, 1)
	return hyperTwoSided(ka, n, a.n, ka+b.atOrBelow(c, s))
}

// pooledQuantile pools a and b (b's values scaled by s) and returns the
// pooled count, the rank of the pooled p-quantile, and its value: the
// smallest value of either side at which the pooled count reaches the
// rank.
func pooledQuantile(a, b *cdf, s, p float64) (n, rank, c float64) {
	n = a.n + b.n
	rank = math.Floor(p*(n-1)) + 1
	// Both sides' values are sorted: merged, they are the pooled values
	// in order.
	vals := make([]float64, 0, len(a.vals)+len(b.vals))
	i, k := 0, 0
	for i < len(a.vals) || k < len(b.vals) {
		if k == len(b.vals) || i < len(a.vals) && a.vals[i] <= b.vals[k]*s {
			vals = append(vals, a.vals[i])
			i++
		} else {
			vals = append(vals, b.vals[k]*s)
			k++
		}
	}
	j := sort.Search(len(vals), func(i int) bool { return a.atOrBelow(vals[i], 1)+b.atOrBelow(vals[i], s) >= rank })
	return n, rank, vals[min(j, len(vals)-1)]
}

// hyperTwoSided is the two-sided p-value of drawing k marked items in t
// draws from n items of which m are marked: twice the smaller tail, at
// most 1.
func hyperTwoSided(k, n, m, t float64) float64 {
	mean := t * m / n
	variance := t * (m / n) * (1 - m/n) * (n - t) / math.Max(n-1, 1)
	if variance <= 0 {
		return 1
	}
	if variance > 400 {
		// Normal with a continuity correction: the exact sums cost a term
		// per possible count, and at this variance agree to well under
		// the 1% that matters here.
		z := (math.Abs(k-mean) - 0.5) / math.Sqrt(variance)
		if z <= 0 {
			return 1
		}
		return math.Min(1, math.Erfc(z/math.Sqrt2))
	}
	logP := func(x float64) float64 {
		return lchoose(m, x) + lchoose(n-m, t-x) - lchoose(n, t)
	}
	kMin, kMax := math.Max(0, t-(n-m)), math.Min(t, m)
	var lower, upper float64
	for x := kMin; x <= k; x++ {
		lower += math.Exp(logP(x))
	}
	for x := k; x <= kMax; x++ {
		upper += math.Exp(logP(x))
	}
	return math.Min(1, 2*math.Min(lower, upper))
}

func lchoose(n, k float64) float64 {
	a, _ := math.Lgamma(n + 1)
	b, _ := math.Lgamma(k + 1)
	c, _ := math.Lgamma(n - k + 1)
	return a - b - c
}

// needed is the fewest samples whose order statistics bound the
// p-quantile at 97.5% (max(p, 1 − p)^n ≤ 1.25%): below it a side says too
// little about that quantile for a row.
func needed(p float64) int64 {
	return int64(math.Ceil(math.Log(verdictAlpha/4) / math.Log(math.Max(p, 1-p))))
}

// quantileRow is one row of a verdict: the two sides' p-quantiles, (b −
// a) / a with its 95% interval and the test's p-value; tooFew with the
// counts each side still needs.
type quantileRow struct {
	a, b         float64
	diff, lo, hi float64
	pValue       float64
	tooFew       bool
	needA, needB int64
	haveA, haveB int64
}

func compareQuantile(a, b cdf, p float64) quantileRow {
	r := quantileRow{haveA: int64(a.n), haveB: int64(b.n), pValue: 1}
	if a.n == 0 || b.n == 0 {
		r.tooFew = true
		return r
	}
	r.a, r.b = a.quantile(p), b.quantile(p)
	if r.a > 0 {
		r.diff = (r.b - r.a) / r.a
	}
	need := needed(p)
	if int64(a.n) < need || int64(b.n) < need {
		r.tooFew = true
		r.needA, r.needB = max(need-int64(a.n), 0), max(need-int64(b.n), 0)
		return r
	}
	r.pValue = moodP(&a, &b, 1, p)
	if r.a <= 0 || r.b <= 0 {
		return r // a ratio to or of 0 has no interval (a queue that was empty)
	}
	r.lo, r.hi = ratioInterval(r.b/r.a, r.diff, func(rho float64) bool { return moodP(&a, &b, 1/rho, p) >= verdictAlpha })
	return r
}

// ratioInterval is the interval of (b − a) / a: the ratios ρ = q_b / q_a
// at which B scaled by 1/ρ passes the row's test at 5% (passes), found by
// bisection on log ρ out from the estimate est; it always holds the point
// estimate diff.
func ratioInterval(est, diff float64, passes func(rho float64) bool) (lo, hi float64) {
	bound := func(dir float64) float64 {
		in, out := 0.0, dir*0.1
		for passes(est*math.Exp(out)) && math.Abs(out) < 20 {
			in, out = out, 2*out
		}
		for range 30 {
			mid := (in + out) / 2
			if passes(est * math.Exp(mid)) {
				in = mid
			} else {
				out = mid
			}
		}
		return est*math.Exp(in) - 1
	}
	return math.Min(bound(-1), diff), math.Max(bound(1), diff)
}

// holm marks which of the p-values are significant at family-wise level
// alpha by Holm's step-down method: sorted ascending, the i-th smallest
// (from 0) passes while it is at most alpha / (m − i).
func holm(ps []float64, alpha float64) []bool {
	m := len(ps)
	idx := make([]int, m)
	for i := range idx {
		idx[i] = i
	}
	slices.SortStableFunc(idx, func(i, j int) int { return cmp.Compare(ps[i], ps[j]) })
	sig := make([]bool, m)
	for rank, i := range idx {
		if ps[i] > alpha/float64(m-rank) {
			break
		}
		sig[i] = true
	}
	return sig
}
