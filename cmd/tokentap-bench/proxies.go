package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	pmeasure "github.com/tokentap/tokentap/proxy/measure"
)

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

// benchSettings are the proxies bench's flags.
type benchSettings struct {
	outDir, bin, beforeBin, nginxBin, haproxyBin string
	burstN, rounds, idle, gmp, tokens            int
	burstGap, roundTime, gap                     time.Duration
	goRelay, fastRelay, noLog                    bool
	levels                                       []int
	only                                         map[string]bool // -arms: the arms to run; nil: all
}

// runProxies runs the side-by-side bench: start the arms, then one phase
// after the other (streams at each level, small requests, bursts after a
// lull, idle memory), then write the report.
func runProxies(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench proxies", flag.ContinueOnError)
	var b benchSettings
	fs.StringVar(&b.outDir, "out", "bench-results", "directory for results.json, results.md, the plot and the processes' logs")
	fs.StringVar(&b.bin, "bin", "", "directory holding the tokentap and mockllm binaries (built there when empty)")
	fs.StringVar(&b.beforeBin, "before", "", "directory holding another tokentap binary, measured as the arm tokentap-before beside tokentap (a before/after comparison in one run)")
	fs.StringVar(&b.nginxBin, "nginx", "/usr/sbin/nginx", "nginx binary (empty: skip nginx)")
	fs.StringVar(&b.haproxyBin, "haproxy", "/usr/sbin/haproxy", "HAProxy binary (empty: skip HAProxy)")
	fs.IntVar(&b.burstN, "burst", 100, "requests sent at once in the burst phase (0: skip it)")
	fs.DurationVar(&b.burstGap, "burst-gap", 5*time.Second, "quiet time before each round of bursts")
	render := fs.Bool("render", false, "only rewrite results.md and the plot of -out from its results.json")
	fs.BoolVar(&b.noLog, "nolog", false, "also measure tokentap with its access log off, as tokentap-nolog (nginx's and HAProxy's are off in this bench)")
	fs.BoolVar(&b.fastRelay, "fasthttp-relay", false, "also measure a bare HTTP proxy on fasthttp (server and client, bodies streamed, nothing measured, same GOMAXPROCS): the floor for tokentap's own libraries")
	fs.BoolVar(&b.goRelay, "go-relay", true, "also measure a bare Go TCP relay (io.Copy, goroutine per direction, same GOMAXPROCS): the floor for a Go proxy")
	fs.IntVar(&b.rounds, "rounds", 5, "measured rounds per condition, after a warm-up round")
	fs.DurationVar(&b.roundTime, "round-time", 3*time.Second, "time per arm per round")
	levelsSpec := fs.String("levels", "1,100,1000", "concurrent streams")
	armsSpec := fs.String("arms", "", "only these arms, comma-separated (direct is always run: the others are measured against it); empty: all")
	fs.IntVar(&b.idle, "idle", 9000, "idle streams held at once for the memory test (each costs a proxy two file descriptors; nginx keeps 1024 more upstream)")
	fs.IntVar(&b.gmp, "gomaxprocs", 1, "GOMAXPROCS of tokentap and the Go relay, and the worker processes of nginx and threads of HAProxy")
	fs.IntVar(&b.tokens, "tokens", 16, "tokens per streamed response")
	fs.DurationVar(&b.gap, "token-gap", 50*time.Millisecond, "backend time between tokens")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *render {
		return rerender(b.outDir, out)
	}
	var err error
	if b.levels, err = parseLevels(*levelsSpec); err != nil {
		return err
	}
	b.only = armSet(*armsSpec)
	if err := os.MkdirAll(b.outDir, 0o755); err != nil {
		return err
	}
	raiseFileLimit()
	if err := b.buildBinaries(); err != nil {
		return err
	}
	arms, accessLog, stopAll, err := b.startArms()
	defer stopAll()
	if err != nil {
		return err
	}
	if b.only != nil {
		arms = slices.DeleteFunc(arms, func(a *arm) bool { return !b.only[a.Name] })
	}

	rep := proxiesReport{
		Machine: machine(),
		Settings: map[string]any{"rounds": b.rounds, "round_time_s": b.roundTime.Seconds(), "levels": b.levels, "tokens_per_stream": b.tokens,
			"token_gap_ms": ms(b.gap), "tokentap_gomaxprocs": b.gmp, "idle_streams": b.idle,
			"burst_requests": b.burstN, "burst_gap_s": b.burstGap.Seconds()},
		Streaming: map[string]map[string][]roundStat{}, Small: map[string][]roundStat{}, Bursts: map[string][]roundStat{}, IdleRSS: map[string]float64{}, IdleCount: b.idle,
	}
	// One client per arm, kept across rounds: connections are opened in the
	// warm-up round, not in a storm at the start of every measured one.
	clients := map[string]*client{}
	for _, a := range arms {
		cl, err := newClient(a.URL, nil, time.Minute, nil)
		if err != nil {
			return err
		}
		clients[a.Name] = cl
		defer cl.closeIdle()
	}
	b.streamingPhase(&rep, arms, clients, accessLog)
	b.smallPhase(&rep, arms, clients)
	b.burstPhase(&rep, arms, clients)
	for _, cl := range clients {
		cl.closeIdle()
	}
	b.idlePhase(&rep, arms)
	return writeReport(b.outDir, &rep, arms, b.levels, out)
}

// parseLevels reads -levels: counts of concurrent streams, comma-separated.
func parseLevels(spec string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(spec, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("-levels: %q is not a count of streams", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// armSet reads -arms: the arms to run, direct always among them (the
// others are measured against it); nil for an empty spec: all.
func armSet(spec string) map[string]bool {
	if spec == "" {
		return nil
	}
	only := map[string]bool{"direct": true}
	for _, a := range strings.Split(spec, ",") {
		only[strings.TrimSpace(a)] = true
	}
	return only
}

// buildBinaries builds tokentap and mockllm when no -bin was given.
func (b *benchSettings) buildBinaries() error {
	if b.bin != "" {
		return nil
	}
	b.bin = filepath.Join(b.outDir, "bin")
	for _, name := range []string{"tokentap", "mockllm"} {
		c := exec.Command("go", "build", "-o", filepath.Join(b.bin, name), "./cmd/"+name)
		c.Stdout, c.Stderr = os.Stderr, os.Stderr
		if err := c.Run(); err != nil {
			return fmt.Errorf("building %s (run from the repository root): %w", name, err)
		}
	}
	return nil
}

// startArms starts the simulated backend and every arm in front of it, and
// waits until each answers. stopAll stops what was started, also on an
// error.
func (b *benchSettings) startArms() (arms []*arm, accessLog string, stopAll func(), err error) {
	var cmds []*exec.Cmd
	stopAll = func() {
		for i := len(cmds) - 1; i >= 0; i-- {
			stop(cmds[i])
		}
	}
	// The simulated backend: no prefill, tokens every token-gap ± 20% (the
	// jitter keeps streams from marching in lockstep), each stamped with
	// its send time.
	mockAddr := freePort()
	mock, err := startProc(b.outDir, "mockllm", filepath.Join(b.bin, "mockllm"), nil, "-listen", mockAddr,
		"-prefill", "1us", "-prefill-per-token", "1ns", "-token-gap", b.gap.String(), "-jitter", "0.2", "-stamp")
	if err != nil {
		return nil, "", stopAll, err
	}
	cmds = append(cmds, mock)
	upstream := "http://" + mockAddr
	arms = []*arm{{Name: "direct", URL: upstream + "/v1/chat/completions"}}

	accessLog = filepath.Join(b.outDir, "tokentap-access.log")
	tt, err := startTokentap(b.outDir, "tokentap", b.bin, b.gmp, upstream, accessLog)
	if err != nil {
		return nil, "", stopAll, err
	}
	cmds = append(cmds, tt.cmd)
	arms = append(arms, tt)

	for _, start := range []struct {
		on bool
		fn func() (*arm, error)
	}{
		{b.beforeBin != "", func() (*arm, error) {
			return startTokentap(b.outDir, "tokentap-before", b.beforeBin, b.gmp, upstream, filepath.Join(b.outDir, "tokentap-before-access.log"))
		}},
		{b.noLog, func() (*arm, error) {
			return startTokentap(b.outDir, "tokentap-nolog", b.bin, b.gmp, upstream, "")
		}},
		{b.goRelay, func() (*arm, error) { return startGoRelay(b.outDir, "go-relay", "relay", b.gmp, mockAddr) }},
		{b.fastRelay, func() (*arm, error) {
			return startGoRelay(b.outDir, "fasthttp-relay", "fasthttp-relay", b.gmp, mockAddr)
		}},
		{b.nginxBin != "", func() (*arm, error) { return startNginx(b.outDir, b.nginxBin, mockAddr, b.gmp, false) }},
		{b.haproxyBin != "", func() (*arm, error) { return startHAProxy(b.outDir, b.haproxyBin, mockAddr, b.gmp) }},
	} {
		if !start.on {
			continue
		}
		a, err := start.fn()
		if err != nil {
			return nil, "", stopAll, err
		}
		cmds = append(cmds, a.cmd)
		arms = append(arms, a)
	}
	for _, a := range arms {
		if err := waitReady(a.URL); err != nil {
			return nil, "", stopAll, fmt.Errorf("%s: %w", a.Name, err)
		}
	}
	return arms, accessLog, stopAll, nil
}

// streamingPhase measures streams at each level, the arms' order rotated
// each round after a warm-up round, and tokentap's accuracy at 100 streams.
func (b *benchSettings) streamingPhase(rep *proxiesReport, arms []*arm, clients map[string]*client, accessLog string) {
	var accResults []result
	for _, level := range b.levels {
		key := strconv.Itoa(level)
		rep.Streaming[key] = map[string][]roundStat{}
		// This process holds each arm's client connections between
		// rounds; where they would not all fit in its descriptors, each
		// arm's are closed after its turn and its next round opens them
		// anew (every arm alike).
		reopen := level*len(arms) > fileLimit()*3/4
		if reopen {
			rep.Settings[fmt.Sprintf("reconnect_each_round_at_%d", level)] = true
		}
		fmt.Fprintf(os.Stderr, "streams: %d concurrent, %d rounds × %v per arm (connections kept between rounds: %v)\n", level, b.rounds, b.roundTime, !reopen)
		for r := 0; r <= b.rounds; r++ {
			for i := range arms {
				a := arms[(i+r)%len(arms)] // rotate the order each round
				p := plan{Model: "m", Workloads: []workload{{Name: "stream", PromptBytes: 100, MaxTokens: b.tokens}}, Stream: true,
					Stamped: true, Concurrency: level, Duration: b.roundTime, Timeout: time.Minute}
				p.URL, p.Client = a.URL, clients[a.Name]
				p.IDPrefix = fmt.Sprintf("s%d-%s-%d-", level, a.Name, r)
				st, res := measure(a, p)
				if reopen {
					clients[a.Name].closeIdle()
				}
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
		if acc, err := compareLog(accessLog, "s100-tokentap-", accResults, pmeasure.Pace{}); err == nil {
			rep.Accuracy = acc
		}
	}
}

// smallPhase measures small non-streamed requests, 64 in flight.
func (b *benchSettings) smallPhase(rep *proxiesReport, arms []*arm, clients map[string]*client) {
	fmt.Fprintf(os.Stderr, "small requests: 64 in flight, %d rounds × %v per arm\n", b.rounds, b.roundTime)
	for r := 0; r <= b.rounds; r++ {
		for i := range arms {
			a := arms[(i+r)%len(arms)]
			p := plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Concurrency: 64, Duration: b.roundTime, Timeout: time.Minute,
				IDPrefix: fmt.Sprintf("t-%s-%d-", a.Name, r), Client: clients[a.Name]}
			st, _ := measure(a, p)
			if r > 0 {
				rep.Small[a.Name] = append(rep.Small[a.Name], st)
			}
		}
	}
}

// burstPhase measures bursts after a lull: the first requests after a
// quiet spell, all at once on warm client connections, as when a batch
// job or a page of users starts. Every proxy has been idle for burst-gap
// (plus the other arms' bursts) when its burst comes.
func (b *benchSettings) burstPhase(rep *proxiesReport, arms []*arm, clients map[string]*client) {
	if b.burstN <= 0 {
		return
	}
	fmt.Fprintf(os.Stderr, "bursts: %d small requests at once after %v quiet, %d rounds\n", b.burstN, b.burstGap, b.rounds)
	for r := 0; r <= b.rounds; r++ {
		time.Sleep(b.burstGap)
		for i := range arms {
			a := arms[(i+r)%len(arms)]
			p := plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Concurrency: b.burstN, Requests: b.burstN,
				Timeout: time.Minute, IDPrefix: fmt.Sprintf("b-%s-%d-", a.Name, r), Client: clients[a.Name]}
			st, _ := measure(a, p)
			if r > 0 {
				rep.Bursts[a.Name] = append(rep.Bursts[a.Name], st)
			}
		}
	}
}

// idlePhase measures each proxy's memory per idle stream.
func (b *benchSettings) idlePhase(rep *proxiesReport, arms []*arm) {
	fmt.Fprintf(os.Stderr, "memory: %d idle streams per proxy\n", b.idle)
	for _, a := range arms {
		if a.pids == nil || a.Name == "go-relay" || a.Name == "fasthttp-relay" {
			// The relays are floors for CPU, not for memory: io.Copy's
			// buffers (32 KiB per direction) and fasthttp's pools say
			// nothing about what a measuring proxy must hold.
			continue
		}
		mb, err := idleRSS(a, b.idle, `{"model":"m","stream":true,"max_tokens":2,"mock_hold_ms":600000,"messages":[{"role":"user","content":"hi"}]}`)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: idle streams: %v\n", a.Name, err)
			continue
		}
		rep.IdleRSS[a.Name] = mb
	}
}
