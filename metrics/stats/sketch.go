package stats

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/DataDog/sketches-go/ddsketch"
	"github.com/DataDog/sketches-go/ddsketch/store"

	"github.com/tokentap/tokentap/metrics"
)

// Statistics across replicas. Percentiles of replicas cannot be averaged,
// but their sketches merge: a DDSketch holds its counts by bucket, and two
// sketches with the same mapping add bucket by bucket into the sketch of
// all their samples together, with the same relative accuracy. So
// /stats?format=sketch gives each group's counts and, per measure, its
// sketch (encoded, with its exact count, sum and maximum), and MergeSketches
// adds the answers of several replicas into the table a single process
// would have given for all their requests (warnings excepted: each replica
// raises its own).

// SketchReport is /stats?format=sketch: Query's groups before rendering.
type SketchReport struct {
	// Format names the sketches' mapping (SketchFormat): only answers of
	// one format merge.
	Format      string        `json:"format"`
	Window      string        `json:"window"`
	WindowS     float64       `json:"window_s"`
	GeneratedAt time.Time     `json:"generated_at"`
	Groups      []SketchGroup `json:"groups"`
}

// SketchGroup is one group's counts and sketches.
type SketchGroup struct {
	Route     string `json:"route"`
	Model     string `json:"model"`
	Tenant    string `json:"tenant"`
	Upstream  string `json:"upstream"`
	Class     string `json:"class,omitempty"`
	Shadow    bool   `json:"shadow,omitempty"`
	Count     int64  `json:"count"`
	Errors    int64  `json:"errors"`
	Limited   int64  `json:"limited"`
	Refused   int64  `json:"refused,omitempty"`
	OutTokens int64  `json:"output_tokens"`
	Judged    int64  `json:"slo_judged"`
	Good      int64  `json:"slo_good"`
	// CostMicro is the priced requests' cost in micro-dollars; Priced,
	// CacheReported and CacheHits as the agg's.
	CostMicro     int64   `json:"cost_micro_usd,omitempty"`
	Priced        int64   `json:"priced,omitempty"`
	CacheReported int64   `json:"cache_reported,omitempty"`
	CacheHits     int64   `json:"cache_hits,omitempty"`
	Missed        []int64 `json:"slo_missed"` // by metrics.SLONames
	Target        float64 `json:"goodput_target,omitempty"`
	// Readings, Stalled and Held are the agg's streams read, those that
	// stalled, and their count by metrics.HopNames.
	Readings int64   `json:"readings,omitempty"`
	Stalled  int64   `json:"stalled,omitempty"`
	Held     []int64 `json:"held_by"`
	// Measures holds every measure's distribution, by MeasureNames.
	Measures []SketchDist `json:"measures"`
}

// SketchDist is one measure's distribution: its sketch (DDSketch's binary
// encoding without the mapping, which every tokentap shares) and the exact
// count, sum and maximum.
type SketchDist struct {
	N      int64   `json:"n"`
	Sum    float64 `json:"sum"`
	Max    float64 `json:"max"`
	Sketch []byte  `json:"sketch,omitempty"`
}

// SketchFormat names the sketches' mapping: replicas merge only sketches
// of the same one.
const SketchFormat = "ddsketch-cubic-0.005"

// MeasureNames are the measures of SketchGroup.Measures, in order.
func MeasureNames() []string {
	names := make([]string, numMeasures+numReading)
	for m := range numPublic {
		names[m] = measureJSONName(m)
	}
	names[mTokensPerS] = "output_tokens_per_s_per_request"
	names[numMeasures+rQoE], names[numMeasures+rFluidity], names[numMeasures+rStall] = "qoe", "fluidity", "stall_ms"
	return names
}

func sketchGroup(k Key, a *agg, target float64) SketchGroup {
	g := SketchGroup{Route: k.Route, Model: k.Model, Tenant: k.Tenant, Upstream: k.Upstream, Class: k.Class, Shadow: k.Shadow,
		Count: a.count, Errors: a.errors, Limited: a.limited, Refused: a.refused, OutTokens: a.outTokens, Judged: a.judged, Good: a.good,
		CostMicro: a.costMicro, Priced: a.priced, CacheReported: a.cacheReported, CacheHits: a.cacheHits,
		Missed: slices.Clone(a.missed[:]), Target: target, Measures: make([]SketchDist, numMeasures+numReading),
		Held: make([]int64, len(metrics.HopNames))}
	for i := range g.Measures {
		d := a.sketchDist(i)
		if d == nil {
			continue
		}
		sd := SketchDist{N: d.count(), Sum: d.total(), Max: d.maximum()}
		d.encode(&sd.Sketch)
		g.Measures[i] = sd
	}
	if ra := a.rd; ra != nil {
		g.Readings, g.Stalled = ra.readings, ra.stalled
		copy(g.Held, ra.held[:])
	}
	return g
}

// sketchDist is a's distribution of SketchGroup.Measures[i] (nil: a
// reading's, and a read no stream).
func (a *agg) sketchDist(i int) *dist {
	if i < numMeasures {
		return &a.d[i]
	}
	if a.rd == nil {
		return nil
	}
	return &a.rd.d[i-numMeasures]
}

// errSketchShape: an answer whose groups do not have this tokentap's
// measures or SLOs (another version).
var errSketchShape = errors.New("the sketches are not in this tokentap's form (another version?)")

// MergeSketches merges the answers of several replicas to one query into
// the table one process would have given for all their requests: groups
// with the same labels add their counts and merge their sketches. The
// rates are over the longest window covered. Warnings are left to each
// replica.
func MergeSketches(reps []SketchReport) (Report, error) {
	sums, order, targets, err := mergeSketchGroups(reps)
	if err != nil {
		return Report{}, err
	}
	out := Report{Groups: []Group{}, Warnings: []Warning{}, Guards: []TrippedGuard{}}
	for _, r := range reps {
		out.Window, out.WindowS = r.Window, max(out.WindowS, r.WindowS)
		if r.GeneratedAt.After(out.GeneratedAt) {
			out.GeneratedAt = r.GeneratedAt
		}
	}
	span := max(time.Duration(out.WindowS*float64(time.Second)), time.Millisecond)
	for _, k := range order {
		out.Groups = append(out.Groups, group_(k, sums[k], span, targets[k]))
	}
	slices.SortFunc(out.Groups, func(a, b Group) int { return compareKeys(a.key(), b.key()) })
	return out, nil
}

// What a replica's answer may hold: tokentap's own answers stay far inside
// these bounds, and an answer past them is refused before anything of it
// is merged (a bin index past 2^32 made sketches-go's dense store panic,
// and one sketch of a few megabytes took 798 MB).
const (
	// maxSketchBytes bounds one encoded sketch: 3,300 bins (1 ns to hours
	// at 0.5%) encode in under 30 KB.
	maxSketchBytes = 64 << 10
	// maxMergedGroups bounds the groups of all the answers merged.
	maxMergedGroups = 100_000
)

// sketchIndexes are the bin indexes of the values a tokentap sketch can
// hold: 1e-7 ms (durations are whole nanoseconds) to 1e10 (a rate of
// tokens per second, or 115 days in milliseconds).
var sketchIndexes = [2]int{valueMapping.Index(1e-7), valueMapping.Index(1e10)}

// checkSketchGroup refuses a group whose counts cannot be a tokentap's.
func checkSketchGroup(g *SketchGroup) error {
	if len(g.Measures) != numMeasures+numReading || len(g.Missed) != metrics.NumSLO || len(g.Held) != len(metrics.HopNames) {
		return errSketchShape
	}
	bad := func(what string) error {
		return fmt.Errorf("a group of route %q: %s (refused: not what a tokentap answers)", g.Route, what)
	}
	switch {
	case g.Count < 0 || g.Errors < 0 || g.Limited < 0 || g.OutTokens < 0 || g.Judged < 0 || g.Good < 0:
		return bad("a negative count")
	case g.Errors+g.Limited > g.Count || g.Judged > g.Count || g.Good > g.Judged:
		return bad("more errors or judged requests than requests, or more good than judged")
	case g.CostMicro < 0 || g.Priced < 0 || g.Priced > g.Count || g.CacheReported < 0 || g.CacheReported > g.Count || g.CacheHits < 0 || g.CacheHits > g.CacheReported:
		return bad("a cost or cache count outside its bounds")
	case !finite(g.Target) || g.Target < 0 || g.Target > 1:
		return bad("a goodput target outside 0…1")
	}
	for _, m := range g.Missed {
		if m < 0 || m > g.Judged {
			return bad("a miss count outside 0…judged")
		}
	}
	var held int64
	for _, h := range g.Held {
		if h < 0 {
			return bad("a negative count of streams held")
		}
		held += h
	}
	if g.Readings < 0 || g.Readings > g.Count || g.Stalled < 0 || g.Stalled > g.Readings || held != g.Readings {
		return bad("counts of streams read outside their bounds")
	}
	for _, sd := range g.Measures {
		switch {
		case sd.N < 0 || !finite(sd.Sum) || !finite(sd.Max) || sd.Sum < 0 || sd.Max < 0:
			return bad("a negative or infinite count, sum or maximum")
		case sd.N == 0 && len(sd.Sketch) > 0, sd.N > 0 && len(sd.Sketch) == 0:
			return bad("a sketch that does not match its count")
		case len(sd.Sketch) > maxSketchBytes:
			return bad(fmt.Sprintf("a sketch of %d bytes (at most %d)", len(sd.Sketch), maxSketchBytes))
		}
	}
	return nil
}

func finite(f float64) bool { return !math.IsNaN(f) && !math.IsInf(f, 0) }

// decodeChecked decodes an encoded sketch of n values into a sparse store
// (memory grows with the bytes given, never with the indexes they name)
// and refuses one whose bins lie outside sketchIndexes, with counts that
// are not whole and positive, negative values, or a total other than n.
func decodeChecked(b []byte, n int64) (*ddsketch.DDSketch, error) {
	sk := ddsketch.NewDDSketch(valueMapping, store.NewSparseStore(), store.NewSparseStore())
	if err := sk.DecodeAndMergeWith(b); err != nil {
		return nil, err
	}
	if !sk.GetNegativeValueStore().IsEmpty() {
		return nil, errors.New("negative values")
	}
	total, err := sk.GetZeroCount(), error(nil)
	sk.GetPositiveValueStore().ForEach(func(i int, c float64) bool {
		if i < sketchIndexes[0] || i > sketchIndexes[1] || c <= 0 || c != math.Trunc(c) {
			err = fmt.Errorf("a bin (index %d, count %g) no tokentap sketch has", i, c)
			return true
		}
		total += c
		return false
	})
	if err != nil {
		return nil, err
	}
	if z := sk.GetZeroCount(); z < 0 || z != math.Trunc(z) || total != float64(n) {
		return nil, fmt.Errorf("its bins count %g values, its count says %d", total, n)
	}
	return sk, nil
}

// mergeSketchGroups adds the groups of reps by their labels, each checked
// first.
func mergeSketchGroups(reps []SketchReport) (map[Key]*agg, []Key, map[Key]float64, error) {
	sums, targets := map[Key]*agg{}, map[Key]float64{}
	var order []Key
	groups := 0
	for _, r := range reps {
		if r.Format != SketchFormat {
			return nil, nil, nil, errSketchShape
		}
		if groups += len(r.Groups); groups > maxMergedGroups {
			return nil, nil, nil, fmt.Errorf("the answers hold more than %d groups", maxMergedGroups)
		}
		for _, g := range r.Groups {
			if err := checkSketchGroup(&g); err != nil {
				return nil, nil, nil, err
			}
			k := Key{Route: g.Route, Model: g.Model, Tenant: g.Tenant, Upstream: g.Upstream, Class: g.Class, Shadow: g.Shadow}
			a := sums[k]
			if a == nil {
				na := newAgg()
				a = &na
				sums[k] = a
				order = append(order, k)
			}
			a.count += g.Count
			a.errors += g.Errors
			a.limited += g.Limited
			a.refused += g.Refused
			a.outTokens += g.OutTokens
			a.costMicro += g.CostMicro
			a.priced += g.Priced
			a.cacheReported += g.CacheReported
			a.cacheHits += g.CacheHits
			a.judged += g.Judged
			a.good += g.Good
			for i := range a.missed {
				a.missed[i] += g.Missed[i]
			}
			if g.Readings > 0 {
				ra := a.reading()
				ra.readings += g.Readings
				ra.stalled += g.Stalled
				for i := range ra.held {
					ra.held[i] += g.Held[i]
				}
			}
			targets[k] = max(targets[k], g.Target)
			for i, sd := range g.Measures {
				if sd.N == 0 {
					continue
				}
				if i >= numMeasures {
					a.reading()
				}
				d := a.sketchDist(i)
				sk, err := decodeChecked(sd.Sketch, sd.N)
				if err != nil {
					return nil, nil, nil, fmt.Errorf("a sketch of route %q refused: %w", g.Route, err)
				}
				d.mergeSketch(sk, sd.N, sd.Sum, sd.Max)
			}
		}
	}
	return sums, order, targets, nil
}
