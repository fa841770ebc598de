package stats

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
)

// Comparison is the verdict on two upstreams of a route over one window
// (GET /stats?route=R&compare=A,B): each measure's p50, p95 and p99 side
// by side with the relative difference (b − a) / a and its 95% confidence
// interval, marked significant when the interval excludes 0.
type Comparison struct {
	Route  string `json:"route"`
	Window string `json:"window"`
	A      string `json:"a"`
	B      string `json:"b"`
	CountA int64  `json:"count_a"`
	CountB int64  `json:"count_b"`
	// Method names how the intervals were computed.
	Method   string    `json:"method"`
	Measures []Diff    `json:"measures"`
	Through  Diff      `json:"throughput"`
	Goodput  PairValue `json:"goodput"`
	Errors   PairValue `json:"error_rate"`
}

// Diff is one figure of both sides.
type Diff struct {
	Name     string  `json:"name"`
	Quantile string  `json:"quantile,omitempty"`
	A        float64 `json:"a"`
	B        float64 `json:"b"`
	// RelativeDiff is (b − a) / a; CILow and CIHigh bound it at 95%.
	RelativeDiff float64 `json:"relative_diff"`
	CILow        float64 `json:"ci_low"`
	CIHigh       float64 `json:"ci_high"`
	Significant  bool    `json:"significant"`
	// N is the samples on each side (a measure's count).
	NA int64 `json:"n_a"`
	NB int64 `json:"n_b"`
}

// PairValue is a share on each side (null when a side judged nothing).
type PairValue struct {
	A *float64 `json:"a"`
	B *float64 `json:"b"`
}

// replicates is the bootstrap's resample count.
const replicates = 2000

// CompareMethod describes the intervals.
const CompareMethod = "bootstrap, 2000 resamples per side: a quantile's resample is the order statistic of its rank, drawn as Beta(r, n−r+1) and read through the side's sketch; a mean's is normal with the sample's variance; 95% percentile interval of (b − a) / a"

// ErrNoSuchUpstream is returned when a compared upstream saw no request
// in the window.
var ErrNoSuchUpstream = errors.New("no request of that upstream in the window")

// Compare compares upstreams a and b of route over window (every model
// and tenant together). seed seeds the resampling (0: fixed).
func (e *Engine) Compare(route, a, b, window string, seed uint64) (Comparison, error) {
	if window == "" {
		window = "5m"
	}
	now := e.now()
	s := e.sync(now)
	sideA, sideB := newAgg(), newAgg()
	e.mu.RLock()
	list := slices.Clone(e.list)
	e.mu.RUnlock()
	for _, g := range list {
		if g.key.Route != route || (g.key.Upstream != a && g.key.Upstream != b) {
			continue
		}
		dst := &sideA
		if g.key.Upstream == b {
			dst = &sideB
		}
		g.mu.Lock()
		g.w.collect(dst, window, s)
		g.mu.Unlock()
	}
	c := Comparison{Route: route, Window: window, A: a, B: b, CountA: sideA.count, CountB: sideB.count, Method: CompareMethod, Measures: []Diff{}}
	if sideA.count == 0 || sideB.count == 0 {
		return c, ErrNoSuchUpstream
	}
	rng := rand.New(rand.NewPCG(seed, 7))
	for m := range numPublic {
		da, db := &sideA.d[m], &sideB.d[m]
		if da.n == 0 || db.n == 0 {
			continue
		}
		for _, q := range []struct {
			name string
			q    float64
		}{{"p50", 0.5}, {"p95", 0.95}, {"p99", 0.99}} {
			d := Diff{Name: measureJSONName(m), Quantile: q.name, A: round3(da.quantile(q.q)), B: round3(db.quantile(q.q)), NA: da.n, NB: db.n}
			d.RelativeDiff, d.CILow, d.CIHigh = relDiffCI(da.quantile(q.q), db.quantile(q.q), func() (float64, float64) {
				return resampleQuantile(rng, da, q.q), resampleQuantile(rng, db, q.q)
			})
			d.Significant = d.CILow > 0 || d.CIHigh < 0
			c.Measures = append(c.Measures, d)
		}
	}
	// Throughput per request in flight: output tokens per second of a
	// request's life, the mean of each request's tokens / E2E.
	ta, tb := &sideA.d[mTokensPerS], &sideB.d[mTokensPerS]
	if ta.n > 0 && tb.n > 0 {
		sa, sb := ta.stddev(), tb.stddev()
		d := Diff{Name: "output_tokens_per_s_per_request", A: round3(ta.mean()), B: round3(tb.mean()), NA: ta.n, NB: tb.n}
		d.RelativeDiff, d.CILow, d.CIHigh = relDiffCI(ta.mean(), tb.mean(), func() (float64, float64) {
			return ta.mean() + rng.NormFloat64()*sa/math.Sqrt(float64(ta.n)), tb.mean() + rng.NormFloat64()*sb/math.Sqrt(float64(tb.n))
		})
		d.Significant = d.CILow > 0 || d.CIHigh < 0
		c.Through = d
	}
	share := func(num, den int64) *float64 {
		if den == 0 {
			return nil
		}
		v := round3(float64(num) / float64(den))
		return &v
	}
	c.Goodput = PairValue{share(sideA.good, sideA.judged), share(sideB.good, sideB.judged)}
	c.Errors = PairValue{share(sideA.errors, sideA.count), share(sideB.errors, sideB.count)}
	return c, nil
}

// relDiffCI returns (b − a) / a and the 2.5th and 97.5th percentiles of
// the same over resamples drawn by draw.
func relDiffCI(a, b float64, draw func() (float64, float64)) (diff, lo, hi float64) {
	if a == 0 {
		return 0, 0, 0
	}
	diffs := make([]float64, 0, replicates)
	for range replicates {
		ra, rb := draw()
		if ra > 0 {
			diffs = append(diffs, (rb-ra)/ra)
		}
	}
	if len(diffs) == 0 {
		return round3((b - a) / a), 0, 0
	}
	slices.Sort(diffs)
	at := func(p float64) float64 { return diffs[min(int(p*float64(len(diffs))), len(diffs)-1)] }
	return round4((b - a) / a), round4(at(0.025)), round4(at(0.975))
}

func round4(v float64) float64 { return math.Round(v*1e4) / 1e4 }

// resampleQuantile draws the q-quantile of a bootstrap resample of d: of
// n draws from d's distribution, the order statistic of rank r = ⌊q(n−1)⌋+1
// is the value at quantile U, U ~ Beta(r, n − r + 1).
func resampleQuantile(rng *rand.Rand, d *dist, q float64) float64 {
	n := float64(d.n)
	r := math.Floor(q*(n-1)) + 1
	u := betaSample(rng, r, n-r+1)
	v, err := d.sk.GetValueAtQuantile(min(max(u, 0), 1))
	if err != nil {
		return 0
	}
	return min(v, d.max)
}

// betaSample draws from Beta(a, b) as X / (X + Y) of two Gamma draws.
func betaSample(rng *rand.Rand, a, b float64) float64 {
	x, y := Gamma(rng, a), Gamma(rng, b)
	return x / (x + y)
}

// Gamma draws from Gamma(k, 1), k > 0, by Marsaglia and Tsang's method
// (ACM TOMS 26(3), 2000; k < 1 through Gamma(k+1)·U^(1/k)).
func Gamma(rng *rand.Rand, k float64) float64 {
	if k < 1 {
		return Gamma(rng, k+1) * math.Pow(rng.Float64(), 1/k)
	}
	d := k - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := rng.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := rng.Float64()
		if u < 1-0.0331*x*x*x*x || math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}

// measureJSONName is measure m's name in /stats.
func measureJSONName(m int) string {
	return [...]string{"ttft_ms", "ttfa_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms", "overhead_ms", "upstream_ttfb_ms",
		"client_ttft_ms", "client_ttfa_ms", "client_e2e_ms", "output_tokens_per_s"}[m]
}

// QuantileDiff compares the q-quantiles of two samples (in any order) as
// Compare compares two upstreams' sketches, with the same resampling, so
// an offline verdict (tokentap-bench compare) reads like a live one. It
// returns (b − a) / a, its 95% interval and whether the interval excludes 0.
func QuantileDiff(a, b []float64, q float64, seed uint64) (diff, lo, hi float64, significant bool) {
	if len(a) == 0 || len(b) == 0 {
		return 0, 0, 0, false
	}
	sa, sb := slices.Clone(a), slices.Clone(b)
	slices.Sort(sa)
	slices.Sort(sb)
	rng := rand.New(rand.NewPCG(seed, 7))
	at := func(s []float64, u float64) float64 {
		return s[min(max(int(math.Ceil(u*float64(len(s))))-1, 0), len(s)-1)]
	}
	pick := func(s []float64) float64 {
		n := float64(len(s))
		r := math.Floor(q*(n-1)) + 1
		return at(s, betaSample(rng, r, n-r+1))
	}
	va, vb := sa[int(math.Floor(q*float64(len(sa)-1)))], sb[int(math.Floor(q*float64(len(sb)-1)))]
	diff, lo, hi = relDiffCI(va, vb, func() (float64, float64) { return pick(sa), pick(sb) })
	return diff, lo, hi, lo > 0 || hi < 0
}
