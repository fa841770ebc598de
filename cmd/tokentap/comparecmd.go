package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/url"
	"strings"
	"text/tabwriter"

	"github.com/tokentap/tokentap/metrics/stats"
)

// runCompare is `tokentap compare`: the verdict on two upstreams of a
// route, from a running tokentap's /stats. Without A and B it compares
// the route's two busiest upstreams, the busier as A (the baseline).
func runCompare(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap compare", flag.ContinueOnError)
	adminURL := fs.String("admin", "127.0.0.1:9090", "the admin listener: host:port, as tokentap's -admin, or a base URL (https://…); several, comma separated, merge their replicas")
	route := fs.String("route", "", "the route (required)")
	window := fs.String("window", "5m", "1m, 5m, 15m, 1h or all")
	class := fs.String("class", "", "compare only the requests of this class (e.g. in-long.out-short)")
	var ac adminClient
	ac.flags(fs)
	asJSON := fs.Bool("json", false, "print the JSON as it came")
	all := fs.Bool("v", false, "every row, each class's table and how the intervals were made (default: the verdict, the rows outside the noise and the headline ones)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *route == "" {
		return fmt.Errorf("-route is required")
	}
	if !stats.ValidWindow(*window) {
		return fmt.Errorf("-window must be 1m, 5m, 15m, 1h or all")
	}
	a, b := fs.Arg(0), fs.Arg(1)
	if fs.NArg() != 0 && fs.NArg() != 2 {
		return fmt.Errorf("give two upstreams, or none")
	}
	if admins := strings.Split(*adminURL, ","); len(admins) > 1 {
		return compareReplicas(ctx, admins, ac, *route, *window, *class, a, b, *asJSON, *all, out)
	}
	pair := a + "," + b
	if a == "" {
		pair = "auto" // the server's rule: the guard's baseline and candidate, else by weight
	}
	v := url.Values{"window": {*window}, "route": {*route}, "compare": {pair}}
	if *class != "" {
		v.Set("class", *class)
	}
	body, err := ac.get(ctx, *adminURL, "/stats?"+v.Encode())
	if err != nil {
		return err
	}
	if *asJSON {
		_, err := out.Write(body)
		return err
	}
	var c stats.Comparison
	if err := json.Unmarshal(body, &c); err != nil {
		return fmt.Errorf("/stats: %w", err)
	}
	printComparison(out, c, *all)
	return nil
}

// compareReplicas is `tokentap compare` over several replicas: their
// sketches merged, then the verdict over all their requests.
func compareReplicas(ctx context.Context, admins []string, ac adminClient, route, window, class, a, b string, asJSON, all bool, out io.Writer) error {
	reps, err := sketchesOf(ctx, admins, ac, url.Values{"window": {window}, "route": {route}, "group_by": {"route,upstream,class"}})
	if err != nil {
		return err
	}
	var sides string
	if a == "" {
		// The replicas share one config: the first names the sides.
		if a, b, sides, err = sidesOf(ctx, ac, strings.TrimSpace(admins[0]), route); err != nil {
			return err
		}
	}
	c, err := stats.CompareSketches(reps, route, a, b, class)
	c.Sides = sides
	if err != nil {
		return fmt.Errorf("%s against %s: %w", b, a, err)
	}
	if asJSON {
		return json.NewEncoder(out).Encode(c)
	}
	fmt.Fprintf(out, "%d replicas merged\n", len(reps))
	printComparison(out, c, all)
	return nil
}

// headline are the rows shown without -v: what a user feels first, and
// last ("" is tokens/s per request).
var headline = map[string]bool{"": true, "ttft_ms p50": true, "ttft_ms p95": true, "tpot_ms p50": true, "e2e_ms p50": true, "e2e_ms p95": true, "qoe p99": true}

// printComparison prints a verdict: one line that says it, then a table
// of the rows outside the noise and the headline ones (with all, every
// row), goodput and the error rate, a line per class (with all, each
// class's table) and, with all, how the intervals were made.
func printComparison(out io.Writer, c stats.Comparison, all bool) {
	of := ""
	if c.Class != "" {
		of = ", class " + c.Class
	}
	fmt.Fprintf(out, "route %s, window %s%s: %s (%d requests) against %s (%d requests)\n", c.Route, c.Window, of, c.B, c.CountB, c.A, c.CountA)
	if c.Sides != "" {
		fmt.Fprintf(out, "A = %s, B = %s: %s\n", c.A, c.B, c.Sides)
	}
	fmt.Fprintln(out, verdictLine(c))
	if len(c.Classes) > 1 {
		var cls []string
		for _, k := range c.Classes {
			cls = append(cls, fmt.Sprintf("%s %d/%d", k.Class, k.CountA, k.CountB))
		}
		fmt.Fprintf(out, "compared within classes (%s), each weighing the same on both sides\n", strings.Join(cls, ", "))
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "measure\t%s\t%s\tdifference (95%% interval)\tverdict\twhy\n", c.A, c.B)
	hidden := 0
	row := func(name, key string, d stats.Diff) {
		if !all && !headline[key] {
			hidden++
			return
		}
		if d.TooFew {
			fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%s\t\t\n", name, d.A, d.B, tooFewText(d, c))
			return
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%s\t%s\t%s\n", name, d.A, d.B, diffText(d), verdictText(d, c), d.Why)
	}
	if c.Through.Name != "" {
		row("tokens/s per request", "", c.Through)
	}
	for _, d := range c.Measures {
		name := strings.TrimSuffix(d.Name, "_ms") + " " + d.Quantile + " (ms)"
		if d.Name == "qoe" {
			name = "qoe " + d.Quantile + " (low tail)"
		}
		row(name, d.Name+" "+d.Quantile, d)
	}
	_ = tw.Flush()
	if hidden > 0 {
		fmt.Fprintf(out, "(%d more rows, counted in the verdict: -v shows them)\n", hidden)
	}
	pct := func(v *float64) string {
		if v == nil {
			return "-"
		}
		return fmt.Sprintf("%.1f%%", 100**v)
	}
	fmt.Fprintf(out, "goodput %s → %s; error rate %s → %s\n", pct(c.Goodput.A), pct(c.Goodput.B), pct(c.Errors.A), pct(c.Errors.B))
	for _, one := range c.ByClass {
		if all {
			fmt.Fprintln(out)
			one.Method = ""
			printComparison(out, one, true)
			continue
		}
		fmt.Fprintf(out, "class %s (%d/%d): %s\n", one.Class, one.CountA, one.CountB, verdictLine(one))
	}
	if c.Method != "" && all {
		fmt.Fprintf(out, "intervals: %s\n", c.Method)
	}
}

// verdictLine says a comparison's verdict in a line: the rows outside
// the noise, B's way, or that none is.
func verdictLine(c stats.Comparison) string {
	var worse, better []string
	tested := 0
	for _, d := range append([]stats.Diff{c.Through}, c.Measures...) {
		if d.Name == "" || d.TooFew {
			continue
		}
		tested++
		if !d.Significant {
			continue
		}
		name := strings.TrimSuffix(d.Name, "_ms") + " " + d.Quantile
		if d.Name == c.Through.Name {
			name = "tokens/s"
		}
		txt := fmt.Sprintf("%s %+.0f%%", strings.TrimSpace(name), 100*d.RelativeDiff)
		if d.Better == "b" {
			better = append(better, txt)
		} else {
			worse = append(worse, txt)
		}
	}
	// The first few of each side, in the rows' order (tokens/s, TTFT,
	// then the rest), and how many more.
	few := func(rows []string) string {
		if len(rows) <= 3 {
			return strings.Join(rows, ", ")
		}
		return strings.Join(rows[:3], ", ") + fmt.Sprintf(" and %d more", len(rows)-3)
	}
	switch {
	case tested == 0:
		return "verdict: too few requests to weigh"
	case len(worse)+len(better) == 0:
		return fmt.Sprintf("verdict: %s within the noise of %s (%d rows weighed)", c.B, c.A, tested)
	}
	parts := []string{}
	if len(worse) > 0 {
		parts = append(parts, c.B+" worse: "+few(worse))
	}
	if len(better) > 0 {
		parts = append(parts, c.B+" better: "+few(better))
	}
	return "verdict: " + strings.Join(parts, "; ") + fmt.Sprintf(" (of %d rows weighed)", tested)
}

// tooFewText reads "too few requests (needs 66 more on canary)".
func tooFewText(d stats.Diff, c stats.Comparison) string {
	var need []string
	if d.NeedA > 0 {
		need = append(need, fmt.Sprintf("%d more on %s", d.NeedA, c.A))
	}
	if d.NeedB > 0 {
		need = append(need, fmt.Sprintf("%d more on %s", d.NeedB, c.B))
	}
	if len(need) == 0 {
		return "too few requests"
	}
	return "too few requests (needs " + strings.Join(need, " and ") + ")"
}

// diffText reads "+9% (+6% … +12%)".
// verdictText is a row's verdict: which side does better when the row is
// significant, "within noise" otherwise.
func verdictText(d stats.Diff, c stats.Comparison) string {
	switch d.Better {
	case "b":
		return c.B + " better"
	case "a":
		return c.B + " worse"
	}
	return "within noise"
}

func diffText(d stats.Diff) string {
	return fmt.Sprintf("%+.1f%% (%+.1f%% … %+.1f%%)", 100*d.RelativeDiff, 100*d.CILow, 100*d.CIHigh)
}

// sidesOf asks the admin listener at adm which two upstreams of route a
// comparison weighs (compare=auto: the server's one rule).
func sidesOf(ctx context.Context, ac adminClient, adm, route string) (a, b, sides string, err error) {
	// Its answer names the sides even when one has no request yet (404).
	body, err := ac.get(ctx, adm, "/stats?"+url.Values{"route": {route}, "compare": {"auto"}, "window": {"all"}}.Encode())
	var r struct{ A, B, Sides string }
	if json.Unmarshal(body, &r) != nil || r.A == "" || r.B == "" {
		if err == nil {
			err = fmt.Errorf("route %s: no two upstreams to compare", route)
		}
		return "", "", "", err
	}
	return r.A, r.B, r.Sides, nil
}
