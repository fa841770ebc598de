package stats

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// Comparison is the verdict on two upstreams of a route over one window
// (GET /stats?route=R&compare=A,B): each measure's p50, p95 and p99 side
// by side with the relative difference (b − a) / a and its 95% interval,
// marked significant when the row's test passes Holm's method at 5% for
// the verdict as a whole (verdict.go). A row whose quantile the requests
// at hand cannot bound says so (TooFew), with the requests each side
// still needs.
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
	// Class is the one class compared (CompareClass); empty: all.
	Class string `json:"class,omitempty"`
	// Sides says why A and B are the sides they are, when the server chose
	// them (compare=auto): the guard's baseline and candidate, or the
	// rule for a route without a guard.
	Sides string `json:"sides,omitempty"`
	// Classes are the requests' classes on each side. With more than one,
	// the rows compare within the classes both sides saw, and weigh them
	// the same on both sides (strata.go); ByClass is then the verdict of
	// each of those classes alone.
	Classes []ClassCount `json:"classes,omitempty"`
	ByClass []Comparison `json:"by_class,omitempty"`
}

// ClassCount is one class's requests on each side.
type ClassCount struct {
	Class  string `json:"class"`
	CountA int64  `json:"count_a"`
	CountB int64  `json:"count_b"`
}

// Diff is one figure of both sides.
type Diff struct {
	Name     string  `json:"name"`
	Quantile string  `json:"quantile,omitempty"`
	A        float64 `json:"a"`
	B        float64 `json:"b"`
	// RelativeDiff is (b − a) / a; CILow and CIHigh bound it at 95% (for
	// this row alone).
	RelativeDiff float64 `json:"relative_diff"`
	CILow        float64 `json:"ci_low"`
	CIHigh       float64 `json:"ci_high"`
	// PValue is the row's test; Significant says it passed Holm's method
	// across the verdict's rows (at most a 5% chance of any false alarm in
	// the whole verdict).
	PValue      float64 `json:"p_value"`
	Significant bool    `json:"significant"`
	// TooFew: a side has fewer requests than this quantile takes; NeedA
	// and NeedB are how many more each side needs. The row then has no
	// interval and is never significant.
	TooFew bool  `json:"too_few,omitempty"`
	NeedA  int64 `json:"need_a,omitempty"`
	NeedB  int64 `json:"need_b,omitempty"`
	// N is the samples on each side (a measure's count).
	NA int64 `json:"n_a"`
	NB int64 `json:"n_b"`
	// Better is the side that does better on a significant row ("a" or
	// "b": the lower for times, the higher for throughput and qoe), ""
	// otherwise.
	Better string `json:"better,omitempty"`
	// Why says in words why the row is or is not significant, the same in
	// every view (the dashboard, tokentap compare).
	Why string `json:"why"`
}

// PairValue is a share on each side (null when a side judged nothing).
type PairValue struct {
	A *float64 `json:"a"`
	B *float64 `json:"b"`
}

// CompareMethod describes the intervals.
const CompareMethod = "two-sample quantile test (Mood's, exact: hypergeometric count of A at or below the pooled quantile); 95% interval of (b − a) / a by inverting it under a change of scale; rows with fewer requests than the quantile takes (p50 7, p95 86, p99 436 a side) are too few; significance by Holm's step-down method at 5% across the verdict's rows; throughput is the median of each request's output tokens per second; requests of several classes are compared within the classes both sides saw (the quantile test stratified by class, Mantel-Haenszel style; each side's quantile of its classes mixed in the pooled proportions), and each class alone in by_class"

// ErrNoSuchUpstream is returned when a compared upstream saw no request
// in the window.
var ErrNoSuchUpstream = errors.New("no request of that upstream in the window")

// compareAggs is the verdict on the two sides' aggs, by class.
func compareAggs(route, a, b, window, class string, byClass map[string]*[2]agg) (Comparison, error) {
	var classes []string
	for k := range byClass {
		classes = append(classes, k)
	}
	slices.Sort(classes)
	sideA, sideB := newAgg(), newAgg()
	for _, k := range classes {
		sideA.merge(&byClass[k][0])
		sideB.merge(&byClass[k][1])
	}
	c := Comparison{Route: route, Window: window, A: a, B: b, Class: class, CountA: sideA.count, CountB: sideB.count, Method: CompareMethod, Measures: []Diff{}}
	if sideA.count == 0 || sideB.count == 0 {
		return c, ErrNoSuchUpstream
	}
	var both []string // the classes both sides saw
	for _, k := range classes {
		if p := byClass[k]; p[0].count > 0 && p[1].count > 0 {
			both = append(both, k)
		}
	}
	if len(classes) > 1 {
		for _, k := range classes {
			c.Classes = append(c.Classes, ClassCount{Class: k, CountA: byClass[k][0].count, CountB: byClass[k][1].count})
		}
	}
	strataOf := func(m int) []stratum {
		var st []stratum
		for _, k := range both {
			if da, db := &byClass[k][0].d[m], &byClass[k][1].d[m]; da.count() > 0 && db.count() > 0 {
				st = append(st, stratum{cdfOfDist(da), cdfOfDist(db)})
			}
		}
		return st
	}
	for m := range numPublic {
		st := strataOf(m)
		if len(st) == 0 {
			continue
		}
		for _, q := range []struct {
			name string
			q    float64
		}{{"p50", 0.5}, {"p95", 0.95}, {"p99", 0.99}} {
			c.Measures = append(c.Measures, diffOf(measureJSONName(m), q.name, compareStrata(st, q.q)))
		}
	}
	c.Measures = append(c.Measures, qoeRows(both, byClass)...)
	rows := make([]*Diff, 0, len(c.Measures)+1)
	for i := range c.Measures {
		rows = append(rows, &c.Measures[i])
	}
	// Throughput per request in flight: output tokens per second of a
	// request's life, each request's tokens / E2E, compared at the median.
	if st := strataOf(mTokensPerS); len(st) > 0 {
		c.Through = diffOf("output_tokens_per_s_per_request", "p50", compareStrata(st, 0.5))
		rows = append(rows, &c.Through)
	}
	judge(rows)
	share := func(num, den int64) *float64 {
		if den == 0 {
			return nil
		}
		v := round3(float64(num) / float64(den))
		return &v
	}
	c.Goodput = PairValue{share(sideA.good, sideA.judged), share(sideB.good, sideB.judged)}
	c.Errors = PairValue{share(sideA.errors, sideA.count), share(sideB.errors, sideB.count)}
	if class == "" && len(both) > 1 {
		for _, k := range both {
			if one, err := compareAggs(route, a, b, window, k, map[string]*[2]agg{k: byClass[k]}); err == nil {
				c.ByClass = append(c.ByClass, one)
			}
		}
	}
	return c, nil
}

// qoeRows are the verdict's rows of how the streams read: the QoE
// score's median and low tail (p95 and p99 are the scores 95 and 99% of
// streams reached), the higher the better, with the same test as the
// times', within the classes both sides saw.
func qoeRows(both []string, byClass map[string]*[2]agg) []Diff {
	var st []stratum
	for _, k := range both {
		ra, rb := byClass[k][0].rd, byClass[k][1].rd
		if ra != nil && rb != nil && ra.d[rQoE].count() > 0 && rb.d[rQoE].count() > 0 {
			st = append(st, stratum{cdfOfDist(&ra.d[rQoE]), cdfOfDist(&rb.d[rQoE])})
		}
	}
	if len(st) == 0 {
		return nil
	}
	var rows []Diff
	for _, q := range []struct {
		name string
		q    float64
	}{{"p50", 0.5}, {"p95", 0.05}, {"p99", 0.01}} {
		rows = append(rows, diffOf("qoe", q.name, compareStrata(st, q.q)))
	}
	return rows
}

// CompareSketches is the verdict on upstreams a and b of route over the
// answers of several replicas to /stats?format=sketch for that route,
// grouped by route, upstream and class (the one class given, or all).
func CompareSketches(reps []SketchReport, route, a, b, class string) (Comparison, error) {
	sums, _, _, err := mergeSketchGroups(reps)
	if err != nil {
		return Comparison{}, err
	}
	window := ""
	for _, r := range reps {
		window = r.Window
	}
	byClass := map[string]*[2]agg{}
	for k, g := range sums {
		if k.Route != route || k.Shadow || (k.Upstream != a && k.Upstream != b) || (class != "" && k.Class != class) {
			continue
		}
		pair := byClass[k.Class]
		if pair == nil {
			pair = &[2]agg{newAgg(), newAgg()}
			byClass[k.Class] = pair
		}
		side := 0
		if k.Upstream == b {
			side = 1
		}
		pair[side].merge(g)
	}
	return compareAggs(route, a, b, window, class, byClass)
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

// diffOf makes a verdict row of r; judge marks its significance.
func diffOf(name, q string, r quantileRow) Diff {
	d := Diff{Name: name, Quantile: q, A: round3(r.a), B: round3(r.b), NA: r.haveA, NB: r.haveB, PValue: 1}
	if r.tooFew {
		d.TooFew, d.NeedA, d.NeedB = true, r.needA, r.needB
		return d
	}
	// The sketches place each quantile within RelativeAccuracy of the
	// exact one: the ratio of two is known no finer than that on each
	// side, however many requests there are (two sides far apart gave an
	// interval of no width, "+164.0% … +164.0%").
	const e = RelativeAccuracy
	lo, hi := (1+r.lo)*(1-e)/(1+e)-1, (1+r.hi)*(1+e)/(1-e)-1
	d.RelativeDiff, d.CILow, d.CIHigh, d.PValue = round4(r.diff), round4(lo), round4(hi), r.pValue
	return d
}

// judge marks the rows that Holm's method finds significant among those
// that were tested, and says why of each.
func judge(rows []*Diff) {
	var ps []float64
	var tested []*Diff
	for _, d := range rows {
		if !d.TooFew {
			ps, tested = append(ps, d.PValue), append(tested, d)
		} else {
			d.Why = "too few requests for this quantile: no interval, no verdict"
		}
	}
	for i, sig := range holm(ps, verdictAlpha) {
		d := tested[i]
		d.Significant = sig
		d.Why = why(d, len(tested))
		if sig {
			higherBetter := d.Name == "output_tokens_per_s_per_request" || d.Name == "qoe"
			if (d.RelativeDiff < 0) != higherBetter {
				d.Better = "b"
			} else {
				d.Better = "a"
			}
		}
	}
}

// why says why a tested row is, or is not, significant.
func why(d *Diff, m int) string {
	p := fmt.Sprintf("p = %.2g", d.PValue)
	switch {
	case d.Significant:
		return fmt.Sprintf("outside the noise: %s, under Holm's threshold across %d rows (5%% for the verdict as a whole)", p, m)
	case d.CILow > 0 || d.CIHigh < 0:
		// Its own 95% interval leaves 0 out, but with m rows tested one
		// of them would do so by chance in about m in 20 verdicts.
		return fmt.Sprintf("not significant across %d rows: %s passes 5%% for this row alone (its interval leaves 0 out) but not Holm's threshold for %d rows", m, p, m)
	}
	return fmt.Sprintf("within noise: %s, the interval holds 0", p)
}

func round4(v float64) float64 { return math.Round(v*1e4) / 1e4 }

// QuantileDiff compares the q-quantiles of two samples (in any order) as
// a verdict row does (verdict.go), so that an offline verdict
// (tokentap-bench compare) reads like a live one: (b − a) / a, its 95%
// interval, the row's p-value, and whether a side has too few samples
// for the quantile. Significance over several rows is Holm's.
func QuantileDiff(a, b []float64, q float64) (diff, lo, hi, pValue float64, tooFew bool) {
	sa, sb := slices.Clone(a), slices.Clone(b)
	slices.Sort(sa)
	slices.Sort(sb)
	r := compareQuantile(cdfOfSorted(sa), cdfOfSorted(sb), q)
	return r.diff, r.lo, r.hi, r.pValue, r.tooFew
}

// Needed is the fewest requests a side needs for a verdict row on its
// q-quantile.
func Needed(q float64) int64 { return needed(q) }

// Holm marks which of the p-values are significant with a family-wise
// error of at most alpha (Holm's step-down method).
func Holm(ps []float64, alpha float64) []bool { return holm(ps, alpha) }
