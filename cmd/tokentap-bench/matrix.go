package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/tokentap/tokentap/metrics/stats"
)

// runMatrix runs the upgrade-acceptance grid: three workloads × fresh or
// reused prompt prefix × low, everyday and near-saturation load.
func runMatrix(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench matrix", flag.ContinueOnError)
	var c common
	c.register(fs)
	sat := fs.Int("saturation", 32, "concurrency near saturation; everyday load is a quarter of it, low load is 1")
	n := fs.Int("requests", 40, "counted requests per condition")
	warm := fs.Int("warmup", 5, "warm-up requests per condition")
	if err := fs.Parse(args); err != nil {
		return err
	}
	p0, o, err := c.plan()
	if err != nil {
		return err
	}
	loads := []struct {
		name string
		conc int
	}{{"low", 1}, {"everyday", max(2, *sat/4)}, {"saturation", *sat}}
	var rows []summary
	for _, wn := range []string{"chat", "doc", "gen"} {
		for _, prefix := range []string{"fresh", "reused"} {
			for _, l := range loads {
				p := p0
				p.Workloads = []workload{workloads[wn]}
				p.SharedPrefix = prefix == "reused"
				p.Concurrency, p.Requests, p.Warmup = l.conc, *n, *warm
				name := fmt.Sprintf("%s/%s/%s", wn, prefix, l.name)
				fmt.Fprintf(os.Stderr, "%-28s concurrency %d ...\n", name, l.conc)
				res, wall, err := run(p)
				if err != nil {
					return err
				}
				rows = append(rows, summarize(name, res, wall, *warm, o))
			}
		}
	}
	printMatrix(out, rows)
	return writeJSON(c.jsonOut, map[string]any{"kind": "matrix", "plan": describe(p0), "saturation": *sat, "conditions": rows})
}

func printMatrix(w io.Writer, rows []summary) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "condition\tn\twarm\tTTFT p50\tp95\tp99\tITL p50\tp95\tp99\tE2E p50\tp95\tp99\treq/s\ttok/s\tgoodput/s\terrors\t")
	for _, s := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.1f\t%.1f\t%.1f\t%.2f\t%.2f\t%.2f\t%.0f\t%.0f\t%.0f\t%.2f\t%.0f\t%.2f\t%d\t\n", s.Name, s.Requests, s.Warmup,
			s.TTFT.P50, s.TTFT.P95, s.TTFT.P99, s.ITL.P50, s.ITL.P95, s.ITL.P99, s.E2E.P50, s.E2E.P95, s.E2E.P99,
			s.RequestsPerS, s.OutputTokPerS, s.GoodputPerS, s.Errors)
	}
	tw.Flush()
	fmt.Fprintln(w, "(times in ms)")
}

// runCompare prints two results side by side with relative differences,
// condition by condition (before, after).
func runCompare(args []string, out io.Writer) error {
	if len(args) != 2 {
		return fmt.Errorf("compare takes two JSON files: before.json after.json")
	}
	a, err := loadSummaries(args[0])
	if err != nil {
		return err
	}
	b, err := loadSummaries(args[1])
	if err != nil {
		return err
	}
	var names []string
	for n := range a {
		if _, ok := b[n]; ok {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return fmt.Errorf("no condition in common")
	}
	sort.Strings(names)
	// Every row first, then significance over all of them at once (Holm),
	// as the live verdict does: a table of many rows would otherwise show
	// a false alarm by chance.
	var rows []compareRow
	rng := rand.New(rand.NewPCG(sampleSeed, 1))
	for _, n := range names {
		rows = append(rows, compareCondition(n, a[n], b[n], rng)...)
	}
	var ps []float64
	var at []int
	for i, r := range rows {
		if r.tested {
			ps, at = append(ps, r.p), append(at, i)
		}
	}
	for k, sig := range stats.Holm(ps, 0.05) {
		rows[at[k]].verdict = map[bool]string{true: "outside the noise", false: "within noise"}[sig]
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "condition\tmetric\tbefore\tafter\tchange\t95% interval\tverdict\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%.2f\t%.2f\t%s\t%s\t%s\t\n", r.cond, r.name, r.x, r.y, r.change, r.interval, r.verdict)
	}
	return tw.Flush()
}

// loadSummaries reads a result file's runs by name: its summary, or its
// conditions.
func loadSummaries(path string) (map[string]summary, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var f struct {
		Summary    *summary  `json:"summary"`
		Conditions []summary `json:"conditions"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	m := map[string]summary{}
	if f.Summary != nil {
		m[f.Summary.Name] = *f.Summary
	}
	for _, s := range f.Conditions {
		m[s.Name] = s
	}
	return m, nil
}

// compareRow is one measure of one condition, before and after, with its
// change, its interval and (once every row is in) its verdict.
type compareRow struct {
	cond, name, change, interval, verdict string
	x, y                                  float64
	p                                     float64
	tested                                bool
}

// relChange is y's change from x, in percent.
func relChange(x, y float64) string {
	if x == 0 {
		return "   n/a"
	}
	return fmt.Sprintf("%+6.1f%%", 100*(y-x)/x)
}

// compareCondition is condition n's rows: its measures before (x) and
// after (y), each with the interval of its change where the samples allow.
func compareCondition(n string, x, y summary, rng *rand.Rand) []compareRow {
	var rows []compareRow
	var sx, sy samples
	if x.Samples != nil && y.Samples != nil {
		sx, sy = *x.Samples, *y.Samples
	}
	// The gaps by request where both files keep them; a file written
	// before kept them flat, and they are then taken as independent.
	gapsA, gapsB, flat := sx.ITLByRequest, sy.ITLByRequest, false
	if len(gapsA) == 0 || len(gapsB) == 0 {
		gapsA, gapsB, flat = nil, nil, len(sx.ITL) > 0 && len(sy.ITL) > 0
	}
	for _, m := range []struct {
		name   string
		x, y   float64
		q      float64     // the quantile of the samples below, for the interval
		xs, ys []float64   // nil: no interval
		cx, cy [][]float64 // the gaps by request: resampled by request
	}{
		{name: "TTFT p50 ms", x: x.TTFT.P50, y: y.TTFT.P50, q: 0.5, xs: sx.TTFT, ys: sy.TTFT},
		{name: "TTFT p99 ms", x: x.TTFT.P99, y: y.TTFT.P99, q: 0.99, xs: sx.TTFT, ys: sy.TTFT},
		{name: "ITL p50 ms", x: x.ITL.P50, y: y.ITL.P50, q: 0.5, xs: flatIf(flat, sx.ITL), ys: flatIf(flat, sy.ITL), cx: gapsA, cy: gapsB},
		{name: "ITL p99 ms", x: x.ITL.P99, y: y.ITL.P99, q: 0.99, xs: flatIf(flat, sx.ITL), ys: flatIf(flat, sy.ITL), cx: gapsA, cy: gapsB},
		{name: "E2E p50 ms", x: x.E2E.P50, y: y.E2E.P50, q: 0.5, xs: sx.E2E, ys: sy.E2E},
		{name: "E2E p99 ms", x: x.E2E.P99, y: y.E2E.P99, q: 0.99, xs: sx.E2E, ys: sy.E2E},
		{name: "tokens/s per request p50", x: median(sx.TokensPerS), y: median(sy.TokensPerS), q: 0.5, xs: sx.TokensPerS, ys: sy.TokensPerS},
		{name: "req/s", x: x.RequestsPerS, y: y.RequestsPerS}, {name: "tokens/s", x: x.OutputTokPerS, y: y.OutputTokPerS},
		{name: "goodput/s", x: x.GoodputPerS, y: y.GoodputPerS}, {name: "errors", x: float64(x.Errors), y: float64(y.Errors)},
	} {
		if math.IsNaN(m.x) || m.name == "tokens/s per request p50" && (len(m.xs) == 0 || len(m.ys) == 0) {
			continue
		}
		r := compareRow{cond: n, name: m.name, x: m.x, y: m.y, change: relChange(m.x, m.y)}
		var lo, hi, p float64
		var tooFew, tested bool
		switch {
		case len(m.cx) > 0:
			// Before, after and the change from the same gaps the
			// interval is drawn from, resampled by request.
			var d float64
			d, lo, hi, p, tooFew = clusterQuantileDiff(m.cx, m.cy, m.q, rng)
			r.x, r.y = quantileOf(slices.Concat(m.cx...), m.q), quantileOf(slices.Concat(m.cy...), m.q)
			r.change, tested = fmt.Sprintf("%+6.1f%%", 100*d), true
		case len(m.xs) > 0 && len(m.ys) > 0:
			// The same method as the live verdict (/stats?compare), on
			// the samples: before, after and the change from them too,
			// so that the change is the one the interval is about.
			var d float64
			d, lo, hi, p, tooFew = stats.QuantileDiff(m.xs, m.ys, m.q)
			r.x, r.y = quantileOf(m.xs, m.q), quantileOf(m.ys, m.q)
			r.change, tested = fmt.Sprintf("%+6.1f%%", 100*d), true
		}
		switch {
		case tested && tooFew:
			r.verdict = fmt.Sprintf("too few requests (%d a side)", stats.Needed(m.q))
		case tested:
			r.interval = fmt.Sprintf("%+.1f%% … %+.1f%%", 100*lo, 100*hi)
			if flat && m.cx == nil && strings.HasPrefix(m.name, "ITL") {
				r.interval += " (gaps as independent: an older file)"
			}
			r.p, r.tested = p, true
		}
		rows = append(rows, r)
	}
	return rows
}

// flatIf is xs when flat, else nil.
func flatIf(flat bool, xs []float64) []float64 {
	if flat {
		return xs
	}
	return nil
}
