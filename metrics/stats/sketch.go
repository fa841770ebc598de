package stats

import (
	"errors"
	"fmt"
	"slices"
	"time"

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
	Route     string  `json:"route"`
	Model     string  `json:"model"`
	Tenant    string  `json:"tenant"`
	Upstream  string  `json:"upstream"`
	Class     string  `json:"class,omitempty"`
	Shadow    bool    `json:"shadow,omitempty"`
	Count     int64   `json:"count"`
	Errors    int64   `json:"errors"`
	OutTokens int64   `json:"output_tokens"`
	Judged    int64   `json:"slo_judged"`
	Good      int64   `json:"slo_good"`
	Missed    []int64 `json:"slo_missed"` // by metrics.SLONames
	Target    float64 `json:"goodput_target,omitempty"`
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
	names := make([]string, numMeasures)
	for m := range numPublic {
		names[m] = measureJSONName(m)
	}
	names[mTokensPerS] = "output_tokens_per_s_per_request"
	return names
}

// QuerySketches is Query's groups as counts and sketches, to merge with
// other replicas' (MergeSketches).
func (e *Engine) QuerySketches(q Query) SketchReport {
	if q.Window == "" {
		q.Window = "5m"
	}
	now := e.now()
	sums, order, targets, span := e.collect(q, now)
	rep := SketchReport{Format: SketchFormat, Window: q.Window, WindowS: span.Seconds(), GeneratedAt: now.UTC(), Groups: []SketchGroup{}}
	for _, k := range order {
		if a := sums[k]; a.count > 0 {
			rep.Groups = append(rep.Groups, sketchGroup(k, a, targets[k]))
		}
	}
	return rep
}

func sketchGroup(k Key, a *agg, target float64) SketchGroup {
	g := SketchGroup{Route: k.Route, Model: k.Model, Tenant: k.Tenant, Upstream: k.Upstream, Class: k.Class, Shadow: k.Shadow,
		Count: a.count, Errors: a.errors, OutTokens: a.outTokens, Judged: a.judged, Good: a.good,
		Missed: slices.Clone(a.missed[:]), Target: target, Measures: make([]SketchDist, numMeasures)}
	for i := range a.d {
		d := &a.d[i]
		sd := SketchDist{N: d.count(), Sum: d.total(), Max: d.maximum()}
		d.encode(&sd.Sketch)
		g.Measures[i] = sd
	}
	return g
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

// mergeSketchGroups adds the groups of reps by their labels.
func mergeSketchGroups(reps []SketchReport) (map[Key]*agg, []Key, map[Key]float64, error) {
	sums, targets := map[Key]*agg{}, map[Key]float64{}
	var order []Key
	for _, r := range reps {
		if r.Format != SketchFormat {
			return nil, nil, nil, errSketchShape
		}
		for _, g := range r.Groups {
			if len(g.Measures) != numMeasures || len(g.Missed) != metrics.NumSLO {
				return nil, nil, nil, errSketchShape
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
			a.outTokens += g.OutTokens
			a.judged += g.Judged
			a.good += g.Good
			for i := range a.missed {
				a.missed[i] += g.Missed[i]
			}
			targets[k] = max(targets[k], g.Target)
			for i, sd := range g.Measures {
				d := &a.d[i]
				if sd.N == 0 {
					continue
				}
				if err := d.mergeEncoded(sd.Sketch, sd.N, sd.Sum, sd.Max); err != nil {
					return nil, nil, nil, fmt.Errorf("a sketch of %s: %w", g.Route, err)
				}
			}
		}
	}
	return sums, order, targets, nil
}
