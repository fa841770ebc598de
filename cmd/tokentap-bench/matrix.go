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
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "condition\tmetric\tbefore\tafter\tchange\t")
	for _, n := range names {
		x, y := a[n], b[n]
		for _, m := range []struct {
			name string
			x, y float64
		}{
			{"TTFT p50 ms", x.TTFT.P50, y.TTFT.P50}, {"TTFT p99 ms", x.TTFT.P99, y.TTFT.P99},
			{"ITL p50 ms", x.ITL.P50, y.ITL.P50}, {"ITL p99 ms", x.ITL.P99, y.ITL.P99},
			{"E2E p50 ms", x.E2E.P50, y.E2E.P50}, {"E2E p99 ms", x.E2E.P99, y.E2E.P99},
			{"req/s", x.RequestsPerS, y.RequestsPerS}, {"tokens/s", x.OutputTokPerS, y.OutputTokPerS},
			{"goodput/s", x.GoodputPerS, y.GoodputPerS}, {"errors", float64(x.Errors), float64(y.Errors)},
		} {
			if math.IsNaN(m.x) {
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%.2f\t%.2f\t%s\t\n", n, m.name, m.x, m.y, rel(m.x, m.y))
		}
	}
	return tw.Flush()
}
