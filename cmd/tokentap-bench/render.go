// Rendering the side-by-side bench: the derived figures (medians, spreads,
// ratios to direct and to nginx), results.json, results.md and the plot.

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// writeReport derives the figures and writes results.json, results.md and
// the plot.
func writeReport(dir string, rep *proxiesReport, arms []*arm, levels []int, out io.Writer) error {
	rep.Derived = derive(rep, arms, levels)
	if err := writeJSON(filepath.Join(dir, "results.json"), rep); err != nil {
		return err
	}
	md := markdown(rep, arms, levels)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ttft.svg"), []byte(plotSVG(rep, arms, levels)), 0o644); err != nil {
		return err
	}
	fmt.Fprint(out, md)
	return nil
}

// rerender rewrites results.md and the plot of dir from its results.json,
// without measuring again (for a change in how the figures are shown).
func rerender(dir string, out io.Writer) error {
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		return err
	}
	var rep proxiesReport
	if err := json.Unmarshal(b, &rep); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(dir, "results.json"), err)
	}
	var levels []int
	if ls, ok := rep.Settings["levels"].([]any); ok {
		for _, l := range ls {
			if f, ok := l.(float64); ok {
				levels = append(levels, int(f))
			}
		}
	}
	var arms []*arm
	for _, name := range []string{"direct", "tokentap", "tokentap-before", "tokentap-nolog", "go-relay", "fasthttp-relay", "nginx", "haproxy"} {
		if _, ok := rep.Small[name]; !ok {
			continue
		}
		a := &arm{Name: name}
		if name != "direct" {
			a.pids = func() []int { return nil } // measured: its CPU columns are shown
		}
		arms = append(arms, a)
	}
	return writeReport(dir, &rep, arms, levels, out)
}

func median(x []float64) float64 {
	if len(x) == 0 {
		return 0
	}
	s := slices.Clone(x)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// spreadOf gives the median of per-round values and their min and max.
type spread struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

func spreadOf(x []float64) spread {
	if len(x) == 0 {
		return spread{}
	}
	return spread{median(x), slices.Min(x), slices.Max(x)}
}

// added returns, round by round, arm − direct for one statistic.
func added(rep *proxiesReport, level, name string, f func(roundStat) float64) []float64 {
	a, d := rep.Streaming[level][name], rep.Streaming[level]["direct"]
	var out []float64
	for i := range min(len(a), len(d)) {
		out = append(out, f(a[i])-f(d[i]))
	}
	return out
}

func derive(rep *proxiesReport, arms []*arm, levels []int) map[string]any {
	d := map[string]any{}
	stats := map[string]func(roundStat) float64{
		"ttft_p50": func(s roundStat) float64 { return s.TTFTp50 }, "ttft_p99": func(s roundStat) float64 { return s.TTFTp99 },
		"delay_p50": func(s roundStat) float64 { return s.DelayP50 }, "delay_p99": func(s roundStat) float64 { return s.DelayP99 },
	}
	for _, l := range levels {
		key := strconv.Itoa(l)
		for _, a := range arms[1:] {
			for sname, f := range stats {
				d[fmt.Sprintf("added_%s_ms/%s/%s", sname, key, a.Name)] = spreadOf(added(rep, key, a.Name, f))
			}
			var cpuPerK []float64
			for _, s := range rep.Streaming[key][a.Name] {
				if s.Tokens > 0 {
					cpuPerK = append(cpuPerK, s.CPU/float64(s.Tokens)*1000)
				}
			}
			d[fmt.Sprintf("cpu_s_per_1000_tokens/%s/%s", key, a.Name)] = spreadOf(cpuPerK)
		}
	}
	for _, a := range arms {
		var rps, cpu []float64
		for _, s := range rep.Small[a.Name] {
			rps = append(rps, s.ReqPerSec)
			if s.Requests > 0 {
				cpu = append(cpu, s.CPU/float64(s.Requests)*1e6)
			}
		}
		d["small_requests_per_s/"+a.Name] = spreadOf(rps)
		if a.pids != nil {
			d["cpu_us_per_small_request/"+a.Name] = spreadOf(cpu)
		}
		var p50, p99, bcpu []float64
		for _, s := range rep.Bursts[a.Name] {
			p50, p99 = append(p50, s.E2Ep50), append(p99, s.E2Ep99)
			if s.Requests > 0 {
				bcpu = append(bcpu, s.CPU/float64(s.Requests)*1e6)
			}
		}
		d["burst_e2e_p50_ms/"+a.Name], d["burst_e2e_p99_ms/"+a.Name] = spreadOf(p50), spreadOf(p99)
		if a.pids != nil {
			d["cpu_us_per_burst_request/"+a.Name] = spreadOf(bcpu)
		}
	}
	return d
}

func get(d map[string]any, key string) spread {
	s, _ := d[key].(spread)
	return s
}

func ratio(x, y float64) string {
	if y == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", x/y)
}

// addedRatio compares two added times; where either is below zero (the
// path was faster than direct in that run: noise) a ratio says nothing.
func addedRatio(x, y float64) string {
	if x < 0 || y <= 0 {
		return "–"
	}
	return ratio(x, y)
}

func markdown(rep *proxiesReport, arms []*arm, levels []int) string {
	var b strings.Builder
	// nginx's workers and HAProxy's threads follow -gomaxprocs (arms.go).
	n := rep.Settings["tokentap_gomaxprocs"]
	fmt.Fprintf(&b, "Machine: %s, %s cores, %s. tokentap, go-relay (a bare Go TCP relay, the floor for a Go proxy) and fasthttp-relay (a bare HTTP proxy on fasthttp, where run) GOMAXPROCS=%v; nginx %v worker(s); HAProxy nbthread %v.\n",
		rep.Machine["cpu"], rep.Machine["cores"], rep.Machine["kernel"], n, n, n)
	fmt.Fprintf(&b, "%v measured rounds per condition after a warm-up round, arms interleaved in rotating order, %vs per arm per round; "+
		"each figure is the median of the per-round values, [min–max] across rounds.\n\n", rep.Settings["rounds"], rep.Settings["round_time_s"])
	for _, l := range levels {
		streamingTable(&b, rep, arms, l)
	}
	requestTables(&b, rep, arms)
	memoryTables(&b, rep, arms)
	return b.String()
}

// streamingTable writes the table of l concurrent streams.
func streamingTable(b *strings.Builder, rep *proxiesReport, arms []*arm, l int) {
	d := rep.Derived
	key := strconv.Itoa(l)
	fmt.Fprintf(b, "### %d concurrent streams (%v tokens each, %vms apart)\n\n", l, rep.Settings["tokens_per_stream"], rep.Settings["token_gap_ms"])
	b.WriteString("| path | TTFT p50 | TTFT p99 | token delay p50 | token delay p99 | added TTFT p50 | added TTFT p99 | added delay p50 | added delay p99 | vs direct (TTFT p50 / p99 · delay p50 / p99) | added vs nginx's (TTFT p50 / p99 · delay p50 / p99) | CPU s per 1000 tokens |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	med := func(name string, f func(roundStat) float64) float64 {
		var x []float64
		for _, s := range rep.Streaming[key][name] {
			x = append(x, f(s))
		}
		return spreadOf(x).Median
	}
	fTTFT50, fTTFT99 := func(s roundStat) float64 { return s.TTFTp50 }, func(s roundStat) float64 { return s.TTFTp99 }
	fDelay50, fDelay99 := func(s roundStat) float64 { return s.DelayP50 }, func(s roundStat) float64 { return s.DelayP99 }
	for _, a := range arms {
		rs := rep.Streaming[key][a.Name]
		col := func(f func(roundStat) float64) string {
			var x []float64
			for _, s := range rs {
				x = append(x, f(s))
			}
			sp := spreadOf(x)
			return fmt.Sprintf("%.3f [%.3f–%.3f]", sp.Median, sp.Min, sp.Max)
		}
		row := fmt.Sprintf("| %s | %s | %s | %s | %s", a.Name, col(func(s roundStat) float64 { return s.TTFTp50 }), col(func(s roundStat) float64 { return s.TTFTp99 }),
			col(func(s roundStat) float64 { return s.DelayP50 }), col(func(s roundStat) float64 { return s.DelayP99 }))
		if a.Name == "direct" {
			b.WriteString(row + " | – | – | – | – | – | – | – |\n")
			continue
		}
		g := func(s string) float64 { return get(d, fmt.Sprintf("added_%s_ms/%s/%s", s, key, a.Name)).Median }
		ng := func(s string) float64 { return get(d, fmt.Sprintf("added_%s_ms/%s/nginx", s, key)).Median }
		vsDirect := func(f func(roundStat) float64) string { return ratio(med(a.Name, f), med("direct", f)) }
		cpu := get(d, fmt.Sprintf("cpu_s_per_1000_tokens/%s/%s", key, a.Name))
		fmt.Fprintf(b, "%s | %+.3f | %+.3f | %+.3f | %+.3f | %s / %s · %s / %s | %s / %s · %s / %s | %.4f |\n", row,
			g("ttft_p50"), g("ttft_p99"), g("delay_p50"), g("delay_p99"),
			vsDirect(fTTFT50), vsDirect(fTTFT99), vsDirect(fDelay50), vsDirect(fDelay99),
			addedRatio(g("ttft_p50"), ng("ttft_p50")), addedRatio(g("ttft_p99"), ng("ttft_p99")), addedRatio(g("delay_p50"), ng("delay_p50")), addedRatio(g("delay_p99"), ng("delay_p99")),
			cpu.Median)
	}
	b.WriteString("\n(ms; added = path − direct, round by round)\n\n")
}

// requestTables writes the small requests' table and the bursts'.
func requestTables(b *strings.Builder, rep *proxiesReport, arms []*arm) {
	d := rep.Derived
	b.WriteString("### Small non-streamed requests, 64 in flight\n\n| path | requests/s | vs direct | vs nginx | CPU µs per request |\n|---|---|---|---|---|\n")
	nginxRPS := get(d, "small_requests_per_s/nginx").Median
	directRPS := get(d, "small_requests_per_s/direct").Median
	for _, a := range arms {
		r := get(d, "small_requests_per_s/"+a.Name)
		cpu := "–"
		if a.pids != nil {
			cpu = fmt.Sprintf("%.1f", get(d, "cpu_us_per_small_request/"+a.Name).Median)
		}
		fmt.Fprintf(b, "| %s | %.0f [%.0f–%.0f] | %s | %s | %s |\n", a.Name, r.Median, r.Min, r.Max, ratio(r.Median, directRPS), ratio(r.Median, nginxRPS), cpu)
	}
	if len(rep.Bursts) > 0 {
		fmt.Fprintf(b, "\n### Bursts: %v small requests at once after %vs quiet\n\n| path | E2E p50 | E2E p99 | p50 / p99 vs nginx | CPU µs per request |\n|---|---|---|---|---|\n",
			rep.Settings["burst_requests"], rep.Settings["burst_gap_s"])
		n50, n99 := get(d, "burst_e2e_p50_ms/nginx").Median, get(d, "burst_e2e_p99_ms/nginx").Median
		for _, a := range arms {
			p50, p99 := get(d, "burst_e2e_p50_ms/"+a.Name), get(d, "burst_e2e_p99_ms/"+a.Name)
			cpu := "–"
			if a.pids != nil {
				cpu = fmt.Sprintf("%.1f", get(d, "cpu_us_per_burst_request/"+a.Name).Median)
			}
			fmt.Fprintf(b, "| %s | %.3f [%.3f–%.3f] | %.3f [%.3f–%.3f] | %s / %s | %s |\n", a.Name, p50.Median, p50.Min, p50.Max,
				p99.Median, p99.Min, p99.Max, ratio(p50.Median, n50), ratio(p99.Median, n99), cpu)
		}
		b.WriteString("\n(ms, whole requests as the client saw them; the last of a burst waits for all the others)\n")
	}
}

// memoryTables writes idle memory and the measurement's accuracy.
func memoryTables(b *strings.Builder, rep *proxiesReport, arms []*arm) {
	fmt.Fprintf(b, "\n### Memory: %d idle streams open at once\n\n| path | RSS per 1000 idle streams |\n|---|---|\n", rep.IdleCount)
	for _, a := range arms {
		if mb, ok := rep.IdleRSS[a.Name]; ok {
			fmt.Fprintf(b, "| %s | %.1f MB |\n", a.Name, mb)
		}
	}
	if acc := rep.Accuracy; acc != nil {
		fmt.Fprintf(b, "\n### Measurement accuracy at 100 streams (%d requests matched by id)\n\n| | p50 | p99 | client saw the longer time |\n|---|---|---|---|\n", acc.Matched)
		fmt.Fprintf(b, "| abs(tokentap ttft_ms − client TTFT) | %.3f ms | %.3f ms | %.0f%% |\n", acc.TTFT.P50, acc.TTFT.P99, 100*acc.TTFTClientLonger)
		fmt.Fprintf(b, "| abs(tokentap e2e_ms − client E2E) | %.3f ms | %.3f ms | %.0f%% |\n", acc.E2E.P50, acc.E2E.P99, 100*acc.E2EClientLonger)
		if acc.TTFTKernel.N > 0 {
			fmt.Fprintf(b, "| the same, client's kernel receive time: TTFT | %.3f ms | %.3f ms | %.0f%% |\n", acc.TTFTKernel.P50, acc.TTFTKernel.P99, 100*acc.TTFTKernelClientLonger)
			fmt.Fprintf(b, "| the same, client's kernel receive time: E2E | %.3f ms | %.3f ms | %.0f%% |\n", acc.E2EKernel.P50, acc.E2EKernel.P99, 100*acc.E2EKernelClientLonger)
		}
		fmt.Fprintf(b, "| abs(tokentap itl_mean_ms − client mean ITL) | %.3f ms | %.3f ms | |\n", acc.ITL.P50, acc.ITL.P99)
	}
}

// plotSVG draws added TTFT p50 and p99 against concurrency, one line per proxy.
func plotSVG(rep *proxiesReport, arms []*arm, levels []int) string {
	const W, H, pad = 760, 340, 60
	colors := map[string]string{"tokentap": "#d62728", "tokentap-before": "#ff9896", "tokentap-nolog": "#ff7f0e", "nginx": "#2ca02c", "haproxy": "#1f77b4", "go-relay": "#7f7f7f", "fasthttp-relay": "#8c564b"}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	panel := func(x0 int, stat, title string) {
		pw := (W-3*pad)/2 + 0
		ymax := 0.01
		for _, a := range arms[1:] {
			for _, l := range levels {
				ymax = max(ymax, get(rep.Derived, fmt.Sprintf("added_%s_ms/%d/%s", stat, l, a.Name)).Median)
			}
		}
		ymax *= 1.15
		px := func(i int) float64 {
			if len(levels) == 1 {
				return float64(x0) + float64(pw)/2
			}
			return float64(x0) + float64(i)*float64(pw)/float64(len(levels)-1)
		}
		py := func(v float64) float64 { return float64(H-pad) - max(v, 0)/ymax*float64(H-2*pad) }
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-weight="bold">%s</text>`+"\n", x0, pad-25, title)
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, H-pad, x0+pw, H-pad)
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, pad, x0, H-pad)
		for k := 0; k <= 4; k++ {
			v := ymax * float64(k) / 4
			fmt.Fprintf(&b, `<text x="%d" y="%.0f" text-anchor="end">%.2f</text><line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#ddd"/>`+"\n",
				x0-5, py(v)+4, v, x0, py(v), x0+pw, py(v))
		}
		for i, l := range levels {
			fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">%d</text>`+"\n", px(i), H-pad+18, l)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">concurrent streams</text>`+"\n", x0+pw/2, H-pad+36)
		for _, a := range arms[1:] {
			var pts []string
			for i, l := range levels {
				v := get(rep.Derived, fmt.Sprintf("added_%s_ms/%d/%s", stat, l, a.Name)).Median
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(i), py(v)))
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(i), py(v), colors[a.Name])
			}
			fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), colors[a.Name])
		}
	}
	panel(pad, "ttft_p50", "added TTFT p50 over direct (ms)")
	panel(2*pad+(W-3*pad)/2, "ttft_p99", "added TTFT p99 over direct (ms)")
	x := pad
	for _, a := range arms[1:] {
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", x, 12, colors[a.Name], x+16, 22, a.Name)
		x += 100
	}
	b.WriteString("</svg>\n")
	return b.String()
}
