// Rendering the frontier bench: the derived figures (the median over
// rounds, with their range), results.json, results.md and the plot of
// added p99 against offered rate.

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

func writeFrontier(dir string, rep *frontierReport, out io.Writer) error {
	rep.Derived = deriveFrontier(rep)
	if err := writeJSON(filepath.Join(dir, "results.json"), rep); err != nil {
		return err
	}
	md := frontierMarkdown(rep)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "frontier.svg"), []byte(frontierSVG(rep)), 0o644); err != nil {
		return err
	}
	fmt.Fprint(out, md)
	return nil
}

// rerenderFrontier rewrites results.md and the plot from results.json.
func rerenderFrontier(dir string, out io.Writer) error {
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		return err
	}
	var rep frontierReport
	if err := json.Unmarshal(b, &rep); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(dir, "results.json"), err)
	}
	return writeFrontier(dir, &rep, out)
}

func limitsOf(rep *frontierReport) []float64 {
	var out []float64
	if ls, ok := rep.Settings["limits_ms"].([]float64); ok {
		return ls
	}
	if ls, ok := rep.Settings["limits_ms"].([]any); ok {
		for _, l := range ls {
			if v, ok := l.(float64); ok {
				out = append(out, v)
			}
		}
	}
	return out
}

func limitKey(l float64) string { return strconv.FormatFloat(l, 'f', -1, 64) + "ms" }

// deriveFrontier computes every figure per arm: the median over rounds
// and the range, under the keys results.json promises.
func deriveFrontier(rep *frontierReport) map[string]any {
	d := map[string]any{}
	for _, name := range rep.Arms {
		var c1, ttft, cpu, ceil []float64
		fr := map[float64][]float64{}
		capped := map[float64]int{}
		for _, r := range rep.Rounds {
			if a, ok := r.OneClient[name]; ok {
				c1 = append(c1, a.E2Ep99-r.OneClient["direct"].E2Ep99)
			}
			if a, ok := r.Streams[name]; ok && a.Requests > 0 {
				ttft = append(ttft, a.TTFTp99-r.Streams["direct"].TTFTp99)
			}
			if a, ok := r.CPU[name]; ok && a.Requests > 0 && a.CPU > 0 && name != "direct" { // 0: the CPU could not be read
				cpu = append(cpu, a.CPU/float64(a.Requests)*1e6)
			}
			if pts, ok := r.Ceiling[name]; ok {
				ceil = append(ceil, float64(ceilingOf(pts)))
			}
			for _, l := range limitsOf(rep) {
				if pts, ok := r.Sweep[name]; ok {
					v, c := frontierOf(pts, l, r.DirectCap)
					if name == "direct" {
						v, c = r.DirectCap, true
					}
					fr[l] = append(fr[l], v)
					if c {
						capped[l]++
					}
				}
			}
		}
		d["added_p99_ms_c1/"+name] = spreadOf(c1)
		d["added_ttft_p99_ms_512/"+name] = spreadOf(ttft)
		d["stream_ceiling/"+name] = spreadOf(ceil)
		if name != "direct" {
			d["cpu_us_per_request/"+name] = spreadOf(cpu)
		}
		if mb, ok := rep.IdleRSS[name]; ok {
			d["idle_rss_mb_per_1000/"+name] = spreadOf([]float64{mb})
		}
		for l, v := range fr {
			d["frontier_rps_p99_"+limitKey(l)+"/"+name] = spreadOf(v)
			// Rounds in which the arm held every rate up to direct's own
			// ceiling: its frontier is at least the figure.
			d["frontier_capped_rounds_p99_"+limitKey(l)+"/"+name] = capped[l]
		}
	}
	for name, cs := range rep.Costs {
		var req, tok []float64
		for _, c := range cs {
			if c.PerRequest.Requests > 0 {
				req = append(req, c.PerRequest.CPU/float64(c.PerRequest.Requests)*1e6)
			}
			if c.PerToken.Tokens > 0 {
				tok = append(tok, c.PerToken.CPU/float64(c.PerToken.Tokens)*1e6)
			}
		}
		d["cost_cpu_us_per_request/"+name] = spreadOf(req)
		d["cost_cpu_us_per_token/"+name] = spreadOf(tok)
	}
	return d
}

// figure is one row group of results.md.
type figure struct{ key, title, unit string }

func frontierFigures(rep *frontierReport) []figure {
	fs := []figure{{"added_p99_ms_c1", "Added p99 at one client", "ms"}}
	for _, l := range limitsOf(rep) {
		fs = append(fs, figure{"frontier_rps_p99_" + limitKey(l), fmt.Sprintf("Throughput frontier: highest offered rate with added p99 ≤ %s", limitKey(l)), "requests/s"})
	}
	return append(fs,
		figure{"stream_ceiling", "Stream ceiling: most concurrent streams, no lost frame, no stall over 10 token gaps", "streams"},
		figure{"added_ttft_p99_ms_512", "Added TTFT p99, 512 streams in flight (Poisson arrivals)", "ms"},
		figure{"idle_rss_mb_per_1000", "Memory per 1,000 idle streams", "MB"},
		figure{"cpu_us_per_request", "CPU per request", "µs"})
}

func frontierMarkdown(rep *frontierReport) string {
	var b strings.Builder
	d := rep.Derived
	fmt.Fprintf(&b, "Machine: %s, %s cores, %s. Every arm limited to %v CPU (GOMAXPROCS of the Go arms, nginx's workers, HAProxy's threads; the JavaScript gateway runs one thread). ",
		rep.Machine["cpu"], rep.Machine["cores"], rep.Machine["kernel"], rep.Settings["gomaxprocs"])
	arrivals, _ := rep.Settings["arrivals"].(string)
	if arrivals == "" || arrivals == "Poisson (open loop)" {
		arrivals = "open-loop (Poisson)"
	} else {
		arrivals = "of the frontier search: " + arrivals + "; elsewhere open-loop (Poisson)"
	}
	fmt.Fprintf(&b, "Backend: %v ms per request; streams of %v tokens, one every %v ms. Arrivals %s. %d rounds; each figure is the median over them [min–max].\n\n",
		rep.Settings["backend_ms"], rep.Settings["tokens_per_stream"], rep.Settings["pace_ms"], arrivals, len(rep.Rounds))
	if slices.Contains(rep.Arms, "tokentap-h2") || slices.Contains(rep.Arms, "nginx-h2") {
		b.WriteString("The -h2 arms' clients speak HTTP/2 with prior knowledge (h2c), every request a stream of a connection they share (Go's HTTP/2 client, its reads stamped as they return); the others' HTTP/1.1 on raw sockets; every arm's backend is reached over HTTP/1.1. An -h2 arm's added figures are against direct over HTTP/1.1, so they hold the HTTP/2 client's own cost too: compare the -h2 arms with each other (the ×nginx-h2 column).\n\n")
	}
	refs := []string{}
	for _, r := range []string{"nginx", "nginx-h2", "portkey"} {
		if slices.Contains(rep.Arms, r) {
			refs = append(refs, r)
		}
	}
	for _, f := range frontierFigures(rep) {
		fmt.Fprintf(&b, "### %s (%s)\n\n| arm | median | range |", f.title, f.unit)
		for _, r := range refs {
			fmt.Fprintf(&b, " ×%s |", r)
		}
		b.WriteString("\n|---|---:|---:|")
		for range refs {
			b.WriteString("---:|")
		}
		b.WriteString("\n")
		for _, name := range rep.Arms {
			s, ok := d[f.key+"/"+name].(spread)
			if !ok {
				continue
			}
			capped := ""
			if n, _ := d[strings.Replace(f.key, "frontier_rps", "frontier_capped_rounds", 1)+"/"+name].(int); n > 0 && name != "direct" {
				capped = " ≥"
			}
			fmt.Fprintf(&b, "| %s |%s %.4g | %.4g–%.4g |", name, capped, s.Median, s.Min, s.Max)
			for _, r := range refs {
				rf := ratio
				if strings.HasPrefix(f.key, "added") {
					rf = addedRatio // below zero: faster than direct, noise
				}
				fmt.Fprintf(&b, " %s |", rf(s.Median, get(d, f.key+"/"+r).Median))
			}
			b.WriteString("\n")
		}
		b.WriteString("\n")
	}
	b.WriteString(perRateTable(rep))
	if len(rep.Costs) > 0 {
		b.WriteString("### What each measuring feature costs (tokentap variants, A/B in the same run)\n\n| variant | what differs | CPU µs/request | Δ vs tokentap | CPU µs/token | Δ vs tokentap |\n|---|---|---:|---:|---:|---:|\n")
		all := func(k string) float64 { return get(d, k+"/tokentap").Median }
		for _, v := range variants {
			rq, tk := get(d, "cost_cpu_us_per_request/"+v.Name), get(d, "cost_cpu_us_per_token/"+v.Name)
			fmt.Fprintf(&b, "| %s | %s | %.2f [%.2f–%.2f] | %+.2f | %.3f [%.3f–%.3f] | %+.3f |\n", v.Name, rep.Variants[v.Name],
				rq.Median, rq.Min, rq.Max, rq.Median-all("cost_cpu_us_per_request"), tk.Median, tk.Min, tk.Max, tk.Median-all("cost_cpu_us_per_token"))
		}
		b.WriteString("\n")
	}
	if len(rep.Skipped) > 0 {
		b.WriteString("Not measured:\n\n")
		for _, k := range slices.Sorted(maps.Keys(rep.Skipped)) {
			fmt.Fprintf(&b, "- %s: %s\n", k, rep.Skipped[k])
		}
		b.WriteString("\n")
	}
	b.WriteString("LLM gateways tried:\n\n")
	for _, k := range slices.Sorted(maps.Keys(rep.Tried)) {
		fmt.Fprintf(&b, "- %s: %s\n", k, rep.Tried[k])
	}
	return b.String()
}

// perRateTable is the search's added p99 at each offered rate: per arm the
// median over the rounds of each round's median over its probes, and the
// range of every probe of every round; the A/A control's likewise, which
// is the rate's noise.
func perRateTable(rep *frontierReport) string {
	names := append(slices.Clone(rep.Arms[1:]), aaControl)
	rounds := map[string]map[float64][]float64{} // arm → rate → per-round median
	probes := map[string]map[float64][]float64{} // arm → rate → every probe
	rates := map[float64]bool{}
	for _, r := range rep.Rounds {
		for _, name := range names {
			for _, p := range r.Sweep[name] {
				if rounds[name] == nil {
					rounds[name], probes[name] = map[float64][]float64{}, map[float64][]float64{}
				}
				rounds[name][p.Offered] = append(rounds[name][p.Offered], p.Added)
				probes[name][p.Offered] = append(probes[name][p.Offered], p.Probes...)
				rates[p.Offered] = true
			}
		}
	}
	if len(rates) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("### Added p99 at each offered rate of the search (ms)\n\nEach cell: the median over the rounds of each round's median over its probes, then the range of every probe. " +
		"The A/A control is direct measured again as an arm: what it adds is the instrument's own noise at that rate (a rate's band, by which the frontier's limits are widened, is its median).\n\n| offered/s |")
	for _, n := range names {
		fmt.Fprintf(&b, " %s |", n)
	}
	b.WriteString("\n|---:|")
	for range names {
		b.WriteString("---:|")
	}
	b.WriteString("\n")
	for _, rate := range slices.Sorted(maps.Keys(rates)) {
		fmt.Fprintf(&b, "| %.0f |", rate)
		for _, n := range names {
			v := rounds[n][rate]
			if len(v) == 0 {
				b.WriteString(" – |")
				continue
			}
			all := probes[n][rate]
			if len(all) == 0 {
				all = v
			}
			fmt.Fprintf(&b, " %+.2f [%+.1f…%+.1f] |", median(v), slices.Min(all), slices.Max(all))
		}
		b.WriteString("\n")
	}
	b.WriteString("\n")
	return b.String()
}

var armColors = map[string]string{"direct": "#000000", "tokentap": "#d62728", "nginx": "#2ca02c", "haproxy": "#1f77b4", "go-relay": "#7f7f7f",
	"fasthttp-relay": "#8c564b", "portkey": "#9467bd", "tokentap-h2": "#ff9896", "nginx-h2": "#98df8a"}

// frontierSVG plots each arm's added p99 (median over rounds) against the
// offered rate, on a log scale of rate, with the limits as lines.
func frontierSVG(rep *frontierReport) string {
	const W, H, pad = 820, 420, 70
	lims := limitsOf(rep)
	top := 2.0
	if len(lims) > 0 {
		top = 1.5 * lims[len(lims)-1]
	}
	bottom := -1.0
	lo, hi := math.Inf(1), 0.0
	lines := map[string][][2]float64{}
	for _, name := range rep.Arms[1:] {
		byRate := map[float64][]float64{}
		for _, r := range rep.Rounds {
			for _, p := range r.Sweep[name] {
				byRate[p.Offered] = append(byRate[p.Offered], p.Added)
			}
		}
		for _, rate := range slices.Sorted(maps.Keys(byRate)) {
			lines[name] = append(lines[name], [2]float64{rate, median(byRate[rate])})
			lo, hi = min(lo, rate), max(hi, rate)
		}
	}
	if hi <= lo {
		lo, hi = 1, 10
	}
	px := func(rate float64) float64 {
		return pad + (math.Log(rate)-math.Log(lo))/(math.Log(hi)-math.Log(lo))*(W-2*pad)
	}
	py := func(v float64) float64 {
		v = max(bottom, min(v, top))
		return H - pad - (v-bottom)/(top-bottom)*(H-2*pad)
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="%d" y="20" font-weight="bold">Added p99 over direct (ms) against offered rate (requests/s, log scale); above the top: clipped</text>`+"\n", pad)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/><line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n",
		pad, H-pad, W-pad, H-pad, pad, pad, pad, H-pad)
	for k := 0; k <= 5; k++ {
		v := bottom + (top-bottom)*float64(k)/5
		fmt.Fprintf(&b, `<text x="%d" y="%.0f" text-anchor="end">%.1f</text><line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#eee"/>`+"\n", pad-5, py(v)+4, v, pad, py(v), W-pad, py(v))
	}
	for _, l := range lims {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#999" stroke-dasharray="4 3"/><text x="%d" y="%.0f" fill="#666">%s</text>`+"\n",
			pad, py(l), W-pad, py(l), W-pad+4, py(l)+4, limitKey(l))
	}
	for rate := math.Pow(10, math.Floor(math.Log10(lo))); rate <= hi*1.001; rate *= 10 {
		for _, m := range []float64{1, 2, 5} {
			x := rate * m
			if x < lo*0.999 || x > hi*1.001 {
				continue
			}
			fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">%g</text>`+"\n", px(x), H-pad+18, x)
		}
	}
	x := pad
	for _, name := range rep.Arms[1:] {
		c := armColors[name]
		if c == "" {
			c = "#17becf"
		}
		var pts []string
		for _, p := range lines[name] {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p[0]), py(p[1])))
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"/>`+"\n", px(p[0]), py(p[1]), c)
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), c)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", x, H-22, c, x+16, H-12, name)
		x += 110
	}
	b.WriteString("</svg>\n")
	return b.String()
}
