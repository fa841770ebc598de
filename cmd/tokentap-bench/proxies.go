package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// arm is one path from the load generator to the simulated backend.
type arm struct {
	Name string
	URL  string
	cmd  *exec.Cmd
	pids func() []int // processes whose CPU and memory count (none: direct)
}

// roundStat is one arm's figures in one round.
type roundStat struct {
	Requests  int     `json:"requests"`
	Tokens    int     `json:"tokens"`
	Errors    int     `json:"errors"`
	Seconds   float64 `json:"seconds"`
	TTFTp50   float64 `json:"ttft_p50_ms"`
	TTFTp99   float64 `json:"ttft_p99_ms"`
	DelayP50  float64 `json:"token_delay_p50_ms"`
	DelayP99  float64 `json:"token_delay_p99_ms"`
	E2Ep50    float64 `json:"e2e_p50_ms"`
	E2Ep99    float64 `json:"e2e_p99_ms"`
	CPU       float64 `json:"cpu_seconds"`
	ReqPerSec float64 `json:"requests_per_s"`
}

type proxiesReport struct {
	Machine   map[string]string                 `json:"machine"`
	Settings  map[string]any                    `json:"settings"`
	Streaming map[string]map[string][]roundStat `json:"streaming"` // level → arm → rounds
	Small     map[string][]roundStat            `json:"small_requests"`
	Bursts    map[string][]roundStat            `json:"bursts"`
	IdleRSS   map[string]float64                `json:"idle_rss_mb_per_1000_streams"`
	IdleCount int                               `json:"idle_streams"`
	Accuracy  *accuracy                         `json:"accuracy_at_100_streams"`
	Derived   map[string]any                    `json:"derived"`
}

func runProxies(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench proxies", flag.ContinueOnError)
	outDir := fs.String("out", "bench-results", "directory for results.json, results.md, the plot and the processes' logs")
	bin := fs.String("bin", "", "directory holding the tokentap and mockllm binaries (built there when empty)")
	nginxBin := fs.String("nginx", "/usr/sbin/nginx", "nginx binary (empty: skip nginx)")
	haproxyBin := fs.String("haproxy", "/usr/sbin/haproxy", "HAProxy binary (empty: skip HAProxy)")
	burstN := fs.Int("burst", 100, "requests sent at once in the burst phase (0: skip it)")
	burstGap := fs.Duration("burst-gap", 5*time.Second, "quiet time before each round of bursts")
	render := fs.Bool("render", false, "only rewrite results.md and the plot of -out from its results.json")
	goRelay := fs.Bool("go-relay", true, "also measure a bare Go TCP relay (io.Copy, goroutine per direction, same GOMAXPROCS): the floor for a Go proxy")
	rounds := fs.Int("rounds", 5, "measured rounds per condition, after a warm-up round")
	roundTime := fs.Duration("round-time", 3*time.Second, "time per arm per round")
	levelsSpec := fs.String("levels", "1,100,1000", "concurrent streams")
	idle := fs.Int("idle", 9000, "idle streams held at once for the memory test (each costs a proxy two file descriptors; nginx keeps 1024 more upstream)")
	gmp := fs.Int("gomaxprocs", 1, "GOMAXPROCS of tokentap (nginx and HAProxy run one worker thread)")
	tokens := fs.Int("tokens", 16, "tokens per streamed response")
	gap := fs.Duration("token-gap", 50*time.Millisecond, "backend time between tokens")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *render {
		return rerender(*outDir, out)
	}
	var levels []int
	for _, s := range strings.Split(*levelsSpec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			return fmt.Errorf("-levels: %q", s)
		}
		levels = append(levels, n)
	}
	if err := os.MkdirAll(*outDir, 0o755); err != nil {
		return err
	}
	raiseFileLimit()
	if *bin == "" {
		*bin = filepath.Join(*outDir, "bin")
		for _, name := range []string{"tokentap", "mockllm"} {
			b := exec.Command("go", "build", "-o", filepath.Join(*bin, name), "./cmd/"+name)
			b.Stdout, b.Stderr = os.Stderr, os.Stderr
			if err := b.Run(); err != nil {
				return fmt.Errorf("building %s (run from the repository root): %w", name, err)
			}
		}
	}

	// The simulated backend: no prefill, tokens every token-gap ± 20% (the
	// jitter keeps streams from marching in lockstep), each stamped with
	// its send time.
	mockAddr := freePort()
	mock, err := startProc(*outDir, "mockllm", filepath.Join(*bin, "mockllm"), nil, "-listen", mockAddr,
		"-prefill", "1us", "-prefill-per-token", "1ns", "-token-gap", gap.String(), "-jitter", "0.2", "-stamp")
	if err != nil {
		return err
	}
	defer stop(mock)
	upstream := "http://" + mockAddr
	arms := []*arm{{Name: "direct", URL: upstream + "/v1/chat/completions"}}

	ttAddr, ttAdmin := freePort(), freePort()
	accessLog := filepath.Join(*outDir, "tokentap-access.log")
	os.Remove(accessLog)
	tt, err := startProc(*outDir, "tokentap", filepath.Join(*bin, "tokentap"), []string{fmt.Sprintf("GOMAXPROCS=%d", *gmp)},
		"-upstream", upstream, "-listen", ttAddr, "-admin", ttAdmin, "-access-log", accessLog)
	if err != nil {
		return err
	}
	defer stop(tt)
	arms = append(arms, &arm{Name: "tokentap", URL: "http://" + ttAddr + "/v1/chat/completions", cmd: tt, pids: pidsOf(tt)})

	if *goRelay {
		a, err := startGoRelay(*outDir, *gmp, mockAddr)
		if err != nil {
			return err
		}
		defer stop(a.cmd)
		arms = append(arms, a)
	}
	if *nginxBin != "" {
		a, err := startNginx(*outDir, *nginxBin, mockAddr)
		if err != nil {
			return err
		}
		defer stop(a.cmd)
		arms = append(arms, a)
	}
	if *haproxyBin != "" {
		a, err := startHAProxy(*outDir, *haproxyBin, mockAddr)
		if err != nil {
			return err
		}
		defer stop(a.cmd)
		arms = append(arms, a)
	}
	for _, a := range arms {
		if err := waitReady(a.URL); err != nil {
			return fmt.Errorf("%s: %w", a.Name, err)
		}
	}

	rep := proxiesReport{
		Machine: machine(),
		Settings: map[string]any{"rounds": *rounds, "round_time_s": roundTime.Seconds(), "levels": levels, "tokens_per_stream": *tokens,
			"token_gap_ms": ms(*gap), "tokentap_gomaxprocs": *gmp, "idle_streams": *idle,
			"burst_requests": *burstN, "burst_gap_s": burstGap.Seconds()},
		Streaming: map[string]map[string][]roundStat{}, Small: map[string][]roundStat{}, Bursts: map[string][]roundStat{}, IdleRSS: map[string]float64{}, IdleCount: *idle,
	}
	streamBody := func(conc int) plan {
		return plan{Model: "m", Workloads: []workload{{Name: "stream", PromptBytes: 100, MaxTokens: *tokens}}, Stream: true,
			Stamped: true, Concurrency: conc, Duration: *roundTime, Timeout: time.Minute}
	}
	var accResults []result
	// One client per arm, kept across rounds: connections are opened in the
	// warm-up round, not in a storm at the start of every measured one.
	clients := map[string]*client{}
	for _, a := range arms {
		cl, err := newClient(a.URL, nil, time.Minute)
		if err != nil {
			return err
		}
		clients[a.Name] = cl
		defer cl.closeIdle()
	}
	for _, level := range levels {
		key := strconv.Itoa(level)
		rep.Streaming[key] = map[string][]roundStat{}
		fmt.Fprintf(os.Stderr, "streams: %d concurrent, %d rounds × %v per arm\n", level, *rounds, *roundTime)
		for r := 0; r <= *rounds; r++ {
			for i := range arms {
				a := arms[(i+r)%len(arms)] // rotate the order each round
				p := streamBody(level)
				p.URL, p.Client = a.URL, clients[a.Name]
				p.IDPrefix = fmt.Sprintf("s%d-%s-%d-", level, a.Name, r)
				st, res := measure(a, p)
				if r == 0 {
					continue // warm-up
				}
				rep.Streaming[key][a.Name] = append(rep.Streaming[key][a.Name], st)
				if a.Name == "tokentap" && level == 100 {
					accResults = append(accResults, res...)
				}
			}
		}
	}
	if len(accResults) > 0 {
		time.Sleep(500 * time.Millisecond)
		if acc, err := compareLog(accessLog, "s100-tokentap-", accResults); err == nil {
			rep.Accuracy = acc
		}
	}

	fmt.Fprintf(os.Stderr, "small requests: 64 in flight, %d rounds × %v per arm\n", *rounds, *roundTime)
	for r := 0; r <= *rounds; r++ {
		for i := range arms {
			a := arms[(i+r)%len(arms)]
			p := plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Concurrency: 64, Duration: *roundTime, Timeout: time.Minute,
				IDPrefix: fmt.Sprintf("t-%s-%d-", a.Name, r), Client: clients[a.Name]}
			st, _ := measure(a, p)
			if r > 0 {
				rep.Small[a.Name] = append(rep.Small[a.Name], st)
			}
		}
	}

	if *burstN > 0 {
		// Bursts after a lull: the first requests after a quiet spell, all
		// at once on warm client connections, as when a batch job or a
		// page of users starts. Every proxy has been idle for burst-gap
		// (plus the other arms' bursts) when its burst comes.
		fmt.Fprintf(os.Stderr, "bursts: %d small requests at once after %v quiet, %d rounds\n", *burstN, *burstGap, *rounds)
		for r := 0; r <= *rounds; r++ {
			time.Sleep(*burstGap)
			for i := range arms {
				a := arms[(i+r)%len(arms)]
				p := plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Concurrency: *burstN, Requests: *burstN,
					Timeout: time.Minute, IDPrefix: fmt.Sprintf("b-%s-%d-", a.Name, r), Client: clients[a.Name]}
				st, _ := measure(a, p)
				if r > 0 {
					rep.Bursts[a.Name] = append(rep.Bursts[a.Name], st)
				}
			}
		}
	}

	for _, cl := range clients {
		cl.closeIdle()
	}
	fmt.Fprintf(os.Stderr, "memory: %d idle streams per proxy\n", *idle)
	for _, a := range arms {
		if a.pids == nil || a.Name == "go-relay" {
			// The relay is a floor for CPU, not for memory: its io.Copy
			// buffers (32 KiB per direction) say nothing about Go's cost.
			continue
		}
		mb, err := idleRSS(a, *idle)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: idle streams: %v\n", a.Name, err)
			continue
		}
		rep.IdleRSS[a.Name] = mb
	}

	return writeReport(*outDir, &rep, arms, levels, out)
}

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
	for _, name := range []string{"direct", "tokentap", "go-relay", "nginx", "haproxy"} {
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

// measure runs one plan against one arm and reads the arm's CPU time.
func measure(a *arm, p plan) (roundStat, []result) {
	cpu0 := cpuSeconds(a)
	res, wall, _ := run(p)
	cpu := cpuSeconds(a) - cpu0
	var ttft, delay, e2e []time.Duration
	st := roundStat{Seconds: wall.Seconds(), CPU: cpu}
	for i := range res {
		r := &res[i]
		if r.Err != "" || r.Status >= 400 {
			st.Errors++
			continue
		}
		st.Requests++
		st.Tokens += len(r.Tokens)
		if r.TTFT >= 0 {
			ttft = append(ttft, r.TTFT)
		}
		e2e = append(e2e, r.E2E)
		delay = append(delay, r.Delays...)
	}
	d, t, e := newDist(delay), newDist(ttft), newDist(e2e)
	st.TTFTp50, st.TTFTp99, st.DelayP50, st.DelayP99, st.E2Ep50, st.E2Ep99 = t.P50, t.P99, d.P50, d.P99, e.P50, e.P99
	st.ReqPerSec = float64(st.Requests) / max(wall.Seconds(), 1e-9)
	return st, res
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
	d := rep.Derived
	fmt.Fprintf(&b, "Machine: %s, %s cores, %s. tokentap and go-relay (a bare Go TCP relay, the floor for a Go proxy) GOMAXPROCS=%v; nginx 1 worker; HAProxy nbthread 1.\n",
		rep.Machine["cpu"], rep.Machine["cores"], rep.Machine["kernel"], rep.Settings["tokentap_gomaxprocs"])
	fmt.Fprintf(&b, "%v measured rounds per condition after a warm-up round, arms interleaved in rotating order, %vs per arm per round; "+
		"each figure is the median of the per-round values, [min–max] across rounds.\n\n", rep.Settings["rounds"], rep.Settings["round_time_s"])
	for _, l := range levels {
		key := strconv.Itoa(l)
		fmt.Fprintf(&b, "### %d concurrent streams (%v tokens each, %vms apart)\n\n", l, rep.Settings["tokens_per_stream"], rep.Settings["token_gap_ms"])
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
			fmt.Fprintf(&b, "%s | %+.3f | %+.3f | %+.3f | %+.3f | %s / %s · %s / %s | %s / %s · %s / %s | %.4f |\n", row,
				g("ttft_p50"), g("ttft_p99"), g("delay_p50"), g("delay_p99"),
				vsDirect(fTTFT50), vsDirect(fTTFT99), vsDirect(fDelay50), vsDirect(fDelay99),
				addedRatio(g("ttft_p50"), ng("ttft_p50")), addedRatio(g("ttft_p99"), ng("ttft_p99")), addedRatio(g("delay_p50"), ng("delay_p50")), addedRatio(g("delay_p99"), ng("delay_p99")),
				cpu.Median)
		}
		b.WriteString("\n(ms; added = path − direct, round by round)\n\n")
	}
	b.WriteString("### Small non-streamed requests, 64 in flight\n\n| path | requests/s | vs direct | vs nginx | CPU µs per request |\n|---|---|---|---|---|\n")
	nginxRPS := get(d, "small_requests_per_s/nginx").Median
	directRPS := get(d, "small_requests_per_s/direct").Median
	for _, a := range arms {
		r := get(d, "small_requests_per_s/"+a.Name)
		cpu := "–"
		if a.pids != nil {
			cpu = fmt.Sprintf("%.1f", get(d, "cpu_us_per_small_request/"+a.Name).Median)
		}
		fmt.Fprintf(&b, "| %s | %.0f [%.0f–%.0f] | %s | %s | %s |\n", a.Name, r.Median, r.Min, r.Max, ratio(r.Median, directRPS), ratio(r.Median, nginxRPS), cpu)
	}
	if len(rep.Bursts) > 0 {
		fmt.Fprintf(&b, "\n### Bursts: %v small requests at once after %vs quiet\n\n| path | E2E p50 | E2E p99 | p50 / p99 vs nginx | CPU µs per request |\n|---|---|---|---|---|\n",
			rep.Settings["burst_requests"], rep.Settings["burst_gap_s"])
		n50, n99 := get(d, "burst_e2e_p50_ms/nginx").Median, get(d, "burst_e2e_p99_ms/nginx").Median
		for _, a := range arms {
			p50, p99 := get(d, "burst_e2e_p50_ms/"+a.Name), get(d, "burst_e2e_p99_ms/"+a.Name)
			cpu := "–"
			if a.pids != nil {
				cpu = fmt.Sprintf("%.1f", get(d, "cpu_us_per_burst_request/"+a.Name).Median)
			}
			fmt.Fprintf(&b, "| %s | %.3f [%.3f–%.3f] | %.3f [%.3f–%.3f] | %s / %s | %s |\n", a.Name, p50.Median, p50.Min, p50.Max,
				p99.Median, p99.Min, p99.Max, ratio(p50.Median, n50), ratio(p99.Median, n99), cpu)
		}
		b.WriteString("\n(ms, whole requests as the client saw them; the last of a burst waits for all the others)\n")
	}
	fmt.Fprintf(&b, "\n### Memory: %d idle streams open at once\n\n| path | RSS per 1000 idle streams |\n|---|---|\n", rep.IdleCount)
	for _, a := range arms {
		if mb, ok := rep.IdleRSS[a.Name]; ok {
			fmt.Fprintf(&b, "| %s | %.1f MB |\n", a.Name, mb)
		}
	}
	if acc := rep.Accuracy; acc != nil {
		fmt.Fprintf(&b, "\n### Measurement accuracy at 100 streams (%d requests matched by id)\n\n| | p50 | p99 | client saw the longer time |\n|---|---|---|---|\n", acc.Matched)
		fmt.Fprintf(&b, "| abs(tokentap ttft_ms − client TTFT) | %.3f ms | %.3f ms | %.0f%% |\n", acc.TTFT.P50, acc.TTFT.P99, 100*acc.TTFTClientLonger)
		fmt.Fprintf(&b, "| abs(tokentap e2e_ms − client E2E) | %.3f ms | %.3f ms | %.0f%% |\n", acc.E2E.P50, acc.E2E.P99, 100*acc.E2EClientLonger)
		fmt.Fprintf(&b, "| abs(tokentap itl_mean_ms − client mean ITL) | %.3f ms | %.3f ms | |\n", acc.ITL.P50, acc.ITL.P99)
	}
	return b.String()
}

// plotSVG draws added TTFT p50 and p99 against concurrency, one line per proxy.
func plotSVG(rep *proxiesReport, arms []*arm, levels []int) string {
	const W, H, pad = 760, 340, 60
	colors := map[string]string{"tokentap": "#d62728", "nginx": "#2ca02c", "haproxy": "#1f77b4", "go-relay": "#7f7f7f"}
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

// idleRSS opens n idle streams through a and returns the growth of its
// resident memory per 1000 streams, in MB.
func idleRSS(a *arm, n int) (float64, error) {
	runtime.GC()
	time.Sleep(300 * time.Millisecond)
	base := rssKB(a)
	host := strings.TrimPrefix(a.URL, "http://")
	addr, path, _ := strings.Cut(host, "/")
	body := `{"model":"m","stream":true,"max_tokens":2,"mock_hold_ms":600000,"messages":[{"role":"user","content":"hi"}]}`
	req := fmt.Sprintf("POST /%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, addr, len(body), body)
	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 200)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := net.DialTimeout("tcp", addr, 10*time.Second)
			if err == nil {
				c.SetDeadline(time.Now().Add(30 * time.Second))
				_, err = io.WriteString(c, req)
				br := bufio.NewReader(c)
				for err == nil { // until the first token: the stream is open
					var line []byte
					line, err = br.ReadSlice('\n')
					if bytes.HasPrefix(line, []byte("data:")) {
						break
					}
				}
				c.SetDeadline(time.Time{})
			}
			mu.Lock()
			conns[i] = c
			if err != nil && firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	time.Sleep(500 * time.Millisecond)
	with := rssKB(a)
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
	time.Sleep(time.Second)
	if firstErr != nil {
		return 0, firstErr
	}
	return float64(with-base) / 1024 / float64(n) * 1000, nil
}

// startGoRelay runs this program's relay subcommand at tokentap's GOMAXPROCS.
func startGoRelay(dir string, gomaxprocs int, upstream string) (*arm, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	addr := freePort()
	cmd, err := startProc(dir, "go-relay", self, []string{fmt.Sprintf("GOMAXPROCS=%d", gomaxprocs)}, "relay", "-listen", addr, "-upstream", upstream)
	if err != nil {
		return nil, err
	}
	return &arm{Name: "go-relay", URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: pidsOf(cmd)}, nil
}

func startNginx(dir, bin, upstream string) (*arm, error) {
	addr := freePort()
	ndir, _ := filepath.Abs(filepath.Join(dir, "nginx"))
	os.MkdirAll(filepath.Join(ndir, "logs"), 0o755)
	conf := fmt.Sprintf(`worker_processes 1;
worker_rlimit_nofile 20000;
pid %[1]s/nginx.pid;
error_log %[1]s/logs/error.log warn;
events { worker_connections 20000; }
http {
  access_log off;
  upstream backend { server %[2]s; keepalive 1024; keepalive_requests 1000000; }
  server {
    listen %[3]s;
    keepalive_requests 1000000;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
`, ndir, upstream, addr)
	cfg := filepath.Join(ndir, "nginx.conf")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startProc(dir, "nginx", bin, nil, "-p", ndir, "-c", cfg, "-g", "daemon off;")
	if err != nil {
		return nil, err
	}
	return &arm{Name: "nginx", URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: withChildren(cmd)}, nil
}

func startHAProxy(dir, bin, upstream string) (*arm, error) {
	addr := freePort()
	conf := fmt.Sprintf(`global
  nbthread 1
  maxconn 9900
defaults
  mode http
  timeout connect 5s
  timeout client 600s
  timeout server 600s
  option http-no-delay
  http-reuse always
frontend fe
  bind %s
  default_backend be
backend be
  server s1 %s maxconn 9900
`, addr, upstream)
	cfg, _ := filepath.Abs(filepath.Join(dir, "haproxy.cfg"))
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startProc(dir, "haproxy", bin, nil, "-f", cfg, "-db")
	if err != nil {
		return nil, err
	}
	return &arm{Name: "haproxy", URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: withChildren(cmd)}, nil
}

func startProc(dir, name, bin string, env []string, args ...string) (*exec.Cmd, error) {
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return cmd, nil
}

func stop(cmd *exec.Cmd) {
	if cmd == nil || cmd.Process == nil {
		return
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}

func waitReady(url string) error {
	addr, _, _ := strings.Cut(strings.TrimPrefix(url, "http://"), "/")
	for i := 0; i < 200; i++ {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(25 * time.Millisecond)
	}
	return fmt.Errorf("%s did not start listening", addr)
}

func freePort() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil {
		l.Cur = l.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}

func pidsOf(cmd *exec.Cmd) func() []int {
	return func() []int { return []int{cmd.Process.Pid} }
}

// withChildren counts a master process and its workers.
func withChildren(cmd *exec.Cmd) func() []int {
	return func() []int {
		pids := []int{cmd.Process.Pid}
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			if f := procStat(pid); len(f) > 3 && f[3] == strconv.Itoa(cmd.Process.Pid) {
				pids = append(pids, pid)
			}
		}
		return pids
	}
}

// procStat returns the fields of /proc/pid/stat, the command name removed.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return append([]string{"", ""}, strings.Fields(string(b[i+1:]))...)
}

// cpuSeconds is the user+system CPU time of an arm's processes.
// cpuSeconds returns the CPU time the arm's processes have used: the sum
// over their threads of /proc/<pid>/task/<tid>/schedstat (nanoseconds; a
// burst of a hundred small requests is a few ms of CPU, below the 10 ms
// tick of /proc/<pid>/stat, which is the fallback).
func cpuSeconds(a *arm) float64 {
	if a.pids == nil {
		return 0
	}
	var ns, ticks float64
	exact := true
	for _, pid := range a.pids() {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
		if len(tasks) == 0 {
			exact = false
		}
		for _, t := range tasks {
			b, err := os.ReadFile(t)
			f := strings.Fields(string(b))
			if err != nil || len(f) == 0 {
				exact = false
				continue
			}
			v, _ := strconv.ParseFloat(f[0], 64)
			ns += v
		}
		if f := procStat(pid); len(f) > 14 {
			u, _ := strconv.ParseFloat(f[13], 64)
			s, _ := strconv.ParseFloat(f[14], 64)
			ticks += u + s
		}
	}
	if exact {
		return ns / 1e9
	}
	return ticks / 100 // USER_HZ
}

func rssKB(a *arm) int64 {
	var total int64
	for _, pid := range a.pids() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "VmRSS:") {
				f := strings.Fields(line)
				if len(f) > 1 {
					n, _ := strconv.ParseInt(f[1], 10, 64)
					total += n
				}
			}
		}
	}
	return total
}

func machine() map[string]string {
	m := map[string]string{"cores": strconv.Itoa(runtime.NumCPU()), "go": runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				_, v, _ := strings.Cut(line, ":")
				m["cpu"] = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m["kernel"] = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}
