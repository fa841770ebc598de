package stats

import (
	"fmt"
	"math"
	"sync"

	"github.com/tokentap/tokentap/metrics"
)

// The canary guard's statistics: a sequential test.
//
// A guard weighs its two sides once a second from the moment both have
// MinRequests since it was armed (the config or a reset), on all their
// requests since then. Each look asks, for each enabled limit, whether the
// candidate is worse than the baseline beyond the limit with confidence:
//
//   - TTFT p95 and E2E p95: the one-sided two-sample quantile test of the
//     candidate against the baseline scaled by 1 + the limit (the verdict's
//     test, see verdict.go, with its lower tail only). It rejects exactly
//     when the one-sided lower confidence bound of the ratio of the two
//     p95s is above 1 + the limit: the limit is judged against the
//     interval, not against the point estimates.
//   - The error rate: the lower confidence bound of the difference of the
//     two proportions (Newcombe's hybrid score interval, from each side's
//     Wilson interval), against the allowed points.
//
// Looking again every second would make a fixed level meaningless: the
// chance of a false alarm grows with every look. So the level is spent
// over the looks (alpha spending with a union bound): look k may reject at
// GuardAlpha · 6 / (π² k²), shared equally by the limits checked, and the
// sum over every look there will ever be is GuardAlpha. Whatever the
// traffic and however long the guard runs, a candidate that is not worse
// than the limit is stopped with probability at most GuardAlpha (1%).

// GuardAlpha bounds the chance that a guard ever stops a candidate that is
// within its limits, over all of its looks.
const GuardAlpha = 0.01

// lookAlpha is the level look k (from 1) may spend.
func lookAlpha(k int) float64 {
	return GuardAlpha * 6 / (math.Pi * math.Pi * float64(k) * float64(k))
}

// GuardSide is one side of a guard: its requests since the guard was
// armed, as the guard weighs them. Its TTFT and E2E leave out the time
// the client caused (its upload, the admission queue, writes that waited
// for it to read), as Summary's do. Safe for concurrent use.
type GuardSide struct {
	mu        sync.Mutex
	ttft, e2e dist
	n, errs   int64
}

// NewGuardSide returns an empty side.
func NewGuardSide() *GuardSide {
	return &GuardSide{ttft: newDist(), e2e: newDist()}
}

// Observe adds one finished request.
func (s *GuardSide) Observe(r *metrics.Record) {
	clientCaused := max(r.Upload, 0) + max(r.Queue, 0)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.n++
	if isError(r.Outcome) {
		s.errs++
	}
	if r.TTFT >= 0 {
		s.ttft.add(ms(max(r.TTFT-clientCaused-r.ClientStallTTFT, 0)))
	}
	if r.E2E >= 0 {
		s.e2e.add(ms(max(r.E2E-clientCaused-r.ClientStall, 0)))
	}
}

// Count is the side's number of requests.
func (s *GuardSide) Count() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

// Reset empties the side.
func (s *GuardSide) Reset() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ttft.clear()
	s.e2e.clear()
	s.n, s.errs = 0, 0
}

// snapshot reads the side for one look.
func (s *GuardSide) snapshot() (ttft, e2e cdf, n, errs int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return cdfOfDist(&s.ttft), cdfOfDist(&s.e2e), s.n, s.errs
}

// GuardLimits are a guard's limits: shares for the p95s (0.1: +10%),
// points of error rate (0.01: one point); 0 leaves a check out.
type GuardLimits struct {
	TTFTP95, E2EP95, ErrorRate float64
}

// GuardFinding is what one look found: Tripped with the reason, and the
// figures it weighed (for the log, /stats and the dashboard).
type GuardFinding struct {
	Tripped bool
	Reason  string
	Values  map[string]float64
}

// WeighGuard is look k (from 1) of a guard: candidate c against baseline
// b under the limits.
func WeighGuard(c, b *GuardSide, look int, lim GuardLimits) GuardFinding {
	cT, cE, cn, cErr := c.snapshot()
	bT, bE, bn, bErr := b.snapshot()
	checks := 0
	for _, l := range []float64{lim.TTFTP95, lim.E2EP95, lim.ErrorRate} {
		if l > 0 {
			checks++
		}
	}
	f := GuardFinding{Values: map[string]float64{
		"look": float64(look), "candidate_requests": float64(cn), "baseline_requests": float64(bn),
		"candidate_ttft_p95_ms": cT.quantile(0.95), "baseline_ttft_p95_ms": bT.quantile(0.95),
		"candidate_e2e_p95_ms": cE.quantile(0.95), "baseline_e2e_p95_ms": bE.quantile(0.95),
		"candidate_error_rate": rate(cErr, cn), "baseline_error_rate": rate(bErr, bn),
	}}
	if checks == 0 {
		return f
	}
	alpha := lookAlpha(look) / float64(checks)
	f.Values["alpha"] = alpha
	for _, q := range []struct {
		name  string
		key   string
		limit float64
		c, b  *cdf
	}{{"TTFT p95", "ttft_p95", lim.TTFTP95, &cT, &bT}, {"E2E p95", "e2e_p95", lim.E2EP95, &cE, &bE}} {
		if q.limit <= 0 || !quantileWorse(q.c, q.b, 0.95, 1+q.limit, alpha) {
			continue
		}
		lo := ratioLowerBound(q.c, q.b, 0.95, alpha)
		f.Values["ratio_lower_bound_"+q.key] = lo
		f.Tripped = true
		f.Reason = fmt.Sprintf("%s %.1f ms against the baseline's %.1f ms: at least %+.1f%% with %.4g%% confidence (limit %+.1f%%; look %d)",
			q.name, q.c.quantile(0.95), q.b.quantile(0.95), 100*(lo-1), 100*(1-alpha), 100*q.limit, look)
		return f
	}
	if lim.ErrorRate > 0 {
		lo := diffLowerBound(cErr, cn, bErr, bn, alpha)
		f.Values["error_rate_diff_lower_bound"] = lo
		if lo > lim.ErrorRate {
			f.Tripped = true
			f.Reason = fmt.Sprintf("error rate %.2f%% against the baseline's %.2f%%: at least %+.2f points with %.4g%% confidence (limit +%.2f points; look %d)",
				100*rate(cErr, cn), 100*rate(bErr, bn), 100*lo, 100*(1-alpha), 100*lim.ErrorRate, look)
		}
	}
	return f
}

func rate(k, n int64) float64 {
	if n == 0 {
		return 0
	}
	return float64(k) / float64(n)
}

// quantileWorse reports whether the p-quantile of c is above that of b
// scaled by s, at level alpha: the lower tail of the quantile test (few
// of c's values at or below the pooled quantile).
func quantileWorse(c, b *cdf, p, s, alpha float64) bool {
	if c.n == 0 || b.n == 0 {
		return false
	}
	return moodLowerP(c, b, s, p) <= alpha
}

// moodLowerP is the one-sided p-value of the quantile test of a against b
// scaled by s: the chance, were the two one distribution, of as few of a's
// values among the pooled values up to the p-quantile's rank. Values tied
// at the pooled quantile (a sketch's bins hold many) are split at the
// rank as if broken at random, and a's share of the split is taken at its
// largest: the p-value is never below the exact one of any tie-breaking,
// so the test keeps its level, and it uses the rank itself rather than
// every value tied there.
func moodLowerP(a, b *cdf, s, p float64) float64 {
	n, rank, c := pooledQuantile(a, b, s, p)
	kaBelow := a.below(c, 1)
	tBelow := kaBelow + b.below(c, s)
	tiedA := a.atOrBelow(c, 1) - kaBelow
	return hyperLower(kaBelow+math.Min(tiedA, rank-tBelow), n, a.n, rank)
}

// ratioLowerBound is the one-sided lower confidence bound, at level
// alpha, of the ratio of c's p-quantile to b's: the smallest scale of b
// at which c is not found worse (bisection on its logarithm).
func ratioLowerBound(c, b *cdf, p, alpha float64) float64 {
	lo, hi := -20.0, 20.0 // log ratios: worse at lo, not worse at hi
	if !quantileWorse(c, b, p, math.Exp(lo), alpha) {
		return 0
	}
	for range 40 {
		mid := (lo + hi) / 2
		if quantileWorse(c, b, p, math.Exp(mid), alpha) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return math.Exp(lo)
}

// hyperLower is the chance of at most k marked items in t draws from n
// items of which m are marked.
func hyperLower(k, n, m, t float64) float64 {
	mean := t * m / n
	variance := t * (m / n) * (1 - m/n) * (n - t) / math.Max(n-1, 1)
	if variance <= 0 {
		if k >= mean {
			return 1
		}
		return 0
	}
	if variance > 400 {
		// Normal with a continuity correction (see hyperTwoSided).
		return 0.5 * math.Erfc((mean-k-0.5)/math.Sqrt(variance)/math.Sqrt2)
	}
	kMin := math.Max(0, t-(n-m))
	var sum float64
	for x := kMin; x <= k; x++ {
		sum += math.Exp(lchoose(m, x) + lchoose(n-m, t-x) - lchoose(n, t))
	}
	return math.Min(1, sum)
}

// diffLowerBound is the one-sided lower confidence bound, at level alpha,
// of the difference of two error rates x1/n1 − x2/n2: Newcombe's hybrid
// score interval, from the Wilson interval of each.
func diffLowerBound(x1, n1, x2, n2 int64, alpha float64) float64 {
	if n1 == 0 || n2 == 0 {
		return math.Inf(-1)
	}
	z := normalQuantile(1 - alpha)
	p1, p2 := rate(x1, n1), rate(x2, n2)
	l1, _ := wilson(x1, n1, z)
	_, u2 := wilson(x2, n2, z)
	return p1 - p2 - math.Sqrt((p1-l1)*(p1-l1)+(u2-p2)*(u2-p2))
}

// wilson is the Wilson score interval of x successes in n at z.
func wilson(x, n int64, z float64) (lo, hi float64) {
	p, nn := rate(x, n), float64(n)
	z2 := z * z
	center := (p + z2/(2*nn)) / (1 + z2/nn)
	half := z / (1 + z2/nn) * math.Sqrt(p*(1-p)/nn+z2/(4*nn*nn))
	return math.Max(0, center-half), math.Min(1, center+half)
}

// normalQuantile is the standard normal's quantile at p (0 < p < 1).
func normalQuantile(p float64) float64 {
	return -math.Sqrt2 * math.Erfcinv(2*p)
}
