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
		return compareReplicas(ctx, admins, ac, *route, *window, *class, a, b, *asJSON, out)
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
	printComparison(out, c)
	return nil
}

// compareReplicas is `tokentap compare` over several replicas: their
// sketches merged, then the verdict over all their requests.
func compareReplicas(ctx context.Context, admins []string, ac adminClient, route, window, class, a, b string, asJSON bool, out io.Writer) error {
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
	printComparison(out, c)
	return nil
}

// printComparison prints a verdict as a table: per figure, both sides, the
// difference with its 95% interval, and whether it is outside the noise.
func printComparison(out io.Writer, c stats.Comparison) {
	of := ""
	if c.Class != "" {
		of = ", class " + c.Class
	}
	fmt.Fprintf(out, "route %s, window %s%s: %s (%d requests) against %s (%d requests)\n", c.Route, c.Window, of, c.B, c.CountB, c.A, c.CountA)
	if c.Sides != "" {
		fmt.Fprintf(out, "A = %s, B = %s: %s\n", c.A, c.B, c.Sides)
	}
	if len(c.Classes) > 1 {
		var cls []string
		for _, k := range c.Classes {
			cls = append(cls, fmt.Sprintf("%s %d/%d", k.Class, k.CountA, k.CountB))
		}
		fmt.Fprintf(out, "compared within classes (%s), each weighing the same on both sides; each class alone below\n", strings.Join(cls, ", "))
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "measure\t%s\t%s\tdifference (95%% interval)\tverdict\twhy\n", c.A, c.B)
	row := func(name string, d stats.Diff) {
		if d.TooFew {
			fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%s\t\t\n", name, d.A, d.B, tooFewText(d, c))
			return
		}
		fmt.Fprintf(tw, "%s\t%.2f\t%.2f\t%s\t%s\t%s\n", name, d.A, d.B, diffText(d), verdictText(d, c), d.Why)
	}
	if c.Through.Name != "" {
		row("tokens/s per request", c.Through)
	}
	for _, d := range c.Measures {
		row(strings.TrimSuffix(d.Name, "_ms")+" "+d.Quantile+" (ms)", d)
	}
	_ = tw.Flush()
	pct := func(v *float64) string {
		if v == nil {
			return "-"
		}
		return fmt.Sprintf("%.1f%%", 100**v)
	}
	fmt.Fprintf(out, "goodput %s → %s; error rate %s → %s\n", pct(c.Goodput.A), pct(c.Goodput.B), pct(c.Errors.A), pct(c.Errors.B))
	for _, one := range c.ByClass {
		fmt.Fprintln(out)
		one.Method = ""
		printComparison(out, one)
	}
	if c.Method != "" {
		fmt.Fprintf(out, "intervals: %s\n", c.Method)
	}
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
