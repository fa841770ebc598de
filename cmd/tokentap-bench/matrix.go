package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
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
	load := func(path string) (map[string]summary, error) {
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
	a, err := load(args[0])
	if err != nil {
		return err
	}
	b, err := load(args[1])
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
	rel := func(x, y float64) string {
		if x == 0 {
			return "   n/a"
		}
		return fmt.Sprintf("%+6.1f%%", 100*(y-x)/x)
	}
	// Every row first, then significance over all of them at once (Holm),
	// as the live verdict does: a table of many rows would otherwise show
	// a false alarm by chance.
	type row struct {
		cond, name, change, interval, verdict string
		x, y                                  float64
		p                                     float64
		tested                                bool
	}
	var rows []row
	for _, n := range names {
		x, y := a[n], b[n]
		var sx, sy samples
		if x.Samples != nil && y.Samples != nil {
			sx, sy = *x.Samples, *y.Samples
		}
		for _, m := range []struct {
			name   string
			x, y   float64
			q      float64   // the quantile of the samples below, for the interval
			xs, ys []float64 // nil: no interval
		}{
			{"TTFT p50 ms", x.TTFT.P50, y.TTFT.P50, 0.5, sx.TTFT, sy.TTFT}, {"TTFT p99 ms", x.TTFT.P99, y.TTFT.P99, 0.99, sx.TTFT, sy.TTFT},
			{"ITL p50 ms", x.ITL.P50, y.ITL.P50, 0.5, sx.ITL, sy.ITL}, {"ITL p99 ms", x.ITL.P99, y.ITL.P99, 0.99, sx.ITL, sy.ITL},
			{"E2E p50 ms", x.E2E.P50, y.E2E.P50, 0.5, sx.E2E, sy.E2E}, {"E2E p99 ms", x.E2E.P99, y.E2E.P99, 0.99, sx.E2E, sy.E2E},
			{"tokens/s per request p50", median(sx.TokensPerS), median(sy.TokensPerS), 0.5, sx.TokensPerS, sy.TokensPerS},
			{"req/s", x.RequestsPerS, y.RequestsPerS, 0, nil, nil}, {"tokens/s", x.OutputTokPerS, y.OutputTokPerS, 0, nil, nil},
			{"goodput/s", x.GoodputPerS, y.GoodputPerS, 0, nil, nil}, {"errors", float64(x.Errors), float64(y.Errors), 0, nil, nil},
		} {
			if math.IsNaN(m.x) || m.name == "tokens/s per request p50" && (len(m.xs) == 0 || len(m.ys) == 0) {
				continue
			}
			r := row{cond: n, name: m.name, x: m.x, y: m.y, change: rel(m.x, m.y)}
			if len(m.xs) > 0 && len(m.ys) > 0 {
				// The same method as the live verdict (/stats?compare).
				_, lo, hi, p, tooFew := stats.QuantileDiff(m.xs, m.ys, m.q)
				if tooFew {
					r.verdict = fmt.Sprintf("too few requests (%d a side)", stats.Needed(m.q))
				} else {
					r.interval = fmt.Sprintf("%+.1f%% … %+.1f%%", 100*lo, 100*hi)
					r.p, r.tested = p, true
				}
			}
			rows = append(rows, r)
		}
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
