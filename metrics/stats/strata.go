package stats

import (
	"cmp"
	"math"
	"slices"
)

// Comparing like with like: when the requests of the two sides fall in
// several classes (their input and output sizes, a reused prefix:
// proxy.Classes), a side that got more long prompts is slower to its first
// token without being slower. The verdict then compares within classes
// and combines them, so that the class mix weighs the same on both sides:
//
//   - The test is the quantile test stratified by class (in the manner of
//     Mantel and Haenszel): in each class, the count of A's requests at or
//     below that class's pooled p-quantile is hypergeometric when the two
//     sides do not differ within it; their sum is compared with the sum of
//     its means, in units of the root of the sum of its variances (normal,
//     with a continuity correction). A difference of class mix alone moves
//     nothing.
//   - The figures shown are each side's p-quantile of its classes mixed in
//     the same proportions (the two sides' requests pooled, class by
//     class), and the interval inverts the stratified test under a change
//     of scale, as a row's does.
//
// Classes seen on only one side cannot be compared and are left out.

// stratum is one class's requests on each side.
type stratum struct{ a, b cdf }

// compareStrata is compareQuantile over classes: with one class, exactly
// compareQuantile.
func compareStrata(st []stratum, p float64) quantileRow {
	if len(st) == 1 {
		return compareQuantile(st[0].a, st[0].b, p)
	}
	var na, nb float64
	for _, s := range st {
		na, nb = na+s.a.n, nb+s.b.n
	}
	r := quantileRow{haveA: int64(na), haveB: int64(nb), pValue: 1}
	if na == 0 || nb == 0 {
		r.tooFew = true
		return r
	}
	r.a, r.b = mixQuantile(st, p, true), mixQuantile(st, p, false)
	if r.a > 0 {
		r.diff = (r.b - r.a) / r.a
	}
	need := needed(p)
	if int64(na) < need || int64(nb) < need {
		r.tooFew = true
		r.needA, r.needB = max(need-int64(na), 0), max(need-int64(nb), 0)
		return r
	}
	r.pValue = strataP(st, 1, p)
	if r.a <= 0 || r.b <= 0 {
		return r
	}
	r.lo, r.hi = ratioInterval(r.b/r.a, r.diff, func(rho float64) bool { return strataP(st, 1/rho, p) >= verdictAlpha })
	return r
}

// strataP is the two-sided p-value of the stratified quantile test of A
// against B scaled by s.
func strataP(st []stratum, s, p float64) float64 {
	var k, mean, variance float64
	for _, x := range st {
		if x.a.n == 0 || x.b.n == 0 {
			continue
		}
		n, _, c := pooledQuantile(&x.a, &x.b, s, p)
		ka := x.a.atOrBelow(c, 1)
		t := ka + x.b.atOrBelow(c, s)
		k += ka
		mean += t * x.a.n / n
		variance += t * (x.a.n / n) * (1 - x.a.n/n) * (n - t) / math.Max(n-1, 1)
	}
	if variance <= 0 {
		return 1
	}
	z := (math.Abs(k-mean) - 0.5) / math.Sqrt(variance)
	if z <= 0 {
		return 1
	}
	return math.Min(1, math.Erfc(z/math.Sqrt2))
}

// mixQuantile is the p-quantile of side A (or B) with its classes mixed
// in the pooled proportions of the two sides.
func mixQuantile(st []stratum, p float64, sideA bool) float64 {
	type point struct{ v, w float64 }
	var pts []point
	var total float64
	for _, x := range st {
		total += x.a.n + x.b.n
	}
	for _, x := range st {
		c := &x.b
		if sideA {
			c = &x.a
		}
		if c.n == 0 {
			continue
		}
		share := (x.a.n + x.b.n) / total
		prev := 0.0
		for i, v := range c.vals {
			pts = append(pts, point{v, share * (c.cum[i] - prev) / c.n})
			prev = c.cum[i]
		}
	}
	if len(pts) == 0 {
		return 0
	}
	slices.SortFunc(pts, func(x, y point) int { return cmp.Compare(x.v, y.v) })
	var sum, all float64
	for _, q := range pts {
		all += q.w
	}
	for _, q := range pts {
		if sum += q.w; sum >= p*all {
			return q.v
		}
	}
	return pts[len(pts)-1].v
}
