// The frontier bench: performance as public comparisons of LLM gateways
// measure it. Open-loop arrivals (Poisson) against a backend that takes a
// fixed time, every arm under the same CPU limit, and per arm: the added
// p99 at one client, the throughput frontier (the highest offered rate
// whose added p99 stays under 1, 5 and 10 ms), the stream ceiling (the
// most concurrent streams with no lost frame and no stall longer than ten
// token gaps), the added TTFT p99 with 512 streams in flight, memory per
// idle stream and CPU per request.

package main

import (
	"flag"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// frontierSettings are the frontier bench's flags.
type frontierSettings struct {
	outDir, bin, nginxBin, haproxyBin string
	portkeyJS, jsRuntime              string
	trace                             string // "lo-hi": the rates whose tokentap probe is traced
	gmp, rounds, idle, tokens, probes int
	pin                               bool
	probe, backend, pace              time.Duration
	minRate, maxRate, factor          float64
	cpuRate                           float64
	burst                             float64 // shape of the frontier search's gamma gaps (1: Poisson)
	limits                            []float64
	levels                            []int
	costs                             bool
	only                              map[string]bool

	mockAddr string
	clients  map[string]*client // each arm's client per phase, kept across rounds
}

// ratePoint is one arm at one offered rate.
type ratePoint struct {
	Offered  float64 `json:"offered_rps"`
	Achieved float64 `json:"achieved_rps"`
	Requests int     `json:"requests"`
	Errors   int     `json:"errors"`
	P50      float64 `json:"p50_ms"`
	P99      float64 `json:"p99_ms"`
	Added    float64 `json:"added_p99_ms"` // P99 − direct's P99 at this rate, this round: the median over the probes
	Held     bool    `json:"held"`         // the arm kept up with the arrivals (held) in most probes
	// Each probe's added p99 (the arm's p99 less direct's in the same
	// probe), and the rate's noise band: the median of the A/A control's
	// (direct measured again, as an arm) added p99s, in absolute value.
	Probes []float64 `json:"added_probes_ms,omitempty"`
	Band   float64   `json:"noise_band_ms"`
}

// ceilPoint is one arm at one level of concurrent streams.
type ceilPoint struct {
	Streams  int     `json:"streams"`
	Started  int     `json:"started"`
	Errors   int     `json:"errors"`
	Short    int     `json:"short"` // streams that ended with frames missing
	MaxGapMs float64 `json:"max_gap_ms"`
	OK       bool    `json:"ok"`
}

type frontierRound struct {
	OneClient map[string]roundStat   `json:"one_client"`
	Sweep     map[string][]ratePoint `json:"sweep"`
	DirectCap float64                `json:"direct_cap_rps"` // the highest rate direct held: the instrument's own ceiling
	Ceiling   map[string][]ceilPoint `json:"stream_ceiling"`
	Streams   map[string]roundStat   `json:"streams_512"`
	CPU       map[string]roundStat   `json:"cpu_at_fixed_rate"`
}

// costStat is one variant of tokentap in the feature-cost A/B.
type costStat struct {
	PerRequest roundStat `json:"per_request"`
	PerToken   roundStat `json:"per_token"`
}

type frontierReport struct {
	Machine  map[string]string     `json:"machine"`
	Settings map[string]any        `json:"settings"`
	Arms     []string              `json:"arms"`
	Skipped  map[string]string     `json:"skipped,omitempty"` // arm → why it did not run
	Rounds   []frontierRound       `json:"rounds"`
	IdleRSS  map[string]float64    `json:"idle_rss_mb_per_1000_streams"`
	Costs    map[string][]costStat `json:"feature_costs,omitempty"`
	Derived  map[string]any        `json:"derived"`
	Variants map[string]string     `json:"cost_variants,omitempty"`
	Tried    map[string]string     `json:"gateways_tried"`
}

func runFrontier(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench frontier", flag.ContinueOnError)
	var f frontierSettings
	fs.StringVar(&f.outDir, "out", "bench-frontier", "directory for results.json, results.md, frontier.svg and the processes' logs")
	fs.StringVar(&f.bin, "bin", "", "directory holding the tokentap and mockllm binaries (built there when empty)")
	fs.StringVar(&f.nginxBin, "nginx", "/usr/sbin/nginx", "nginx binary (empty or missing: skip nginx)")
	fs.StringVar(&f.haproxyBin, "haproxy", "/usr/sbin/haproxy", "HAProxy binary (empty or missing: skip HAProxy)")
	fs.StringVar(&f.portkeyJS, "portkey", "", "Portkey's gateway: the path of its build/start-server.js (npm @portkey-ai/gateway); empty: skip it")
	fs.StringVar(&f.jsRuntime, "js-runtime", "bun", "the JavaScript runtime that runs -portkey (bun: Node 20 and 22 fail its streamed responses)")
	fs.IntVar(&f.gmp, "gomaxprocs", 1, "the CPU limit of every arm: GOMAXPROCS of the Go arms, nginx's workers, HAProxy's threads (the JavaScript gateway runs on one thread)")
	fs.IntVar(&f.rounds, "rounds", 3, "measured rounds; each figure is the median over them")
	fs.IntVar(&f.probes, "probes", 3, "measurements of every arm at each offered rate of the search, the arms interleaved, with an A/A control (direct measured again); an arm's added p99 at a rate is the median of its probes'")
	fs.BoolVar(&f.pin, "pin", runtime.NumCPU() >= 2, "pin the arms to the last CPU and this program and the backend to the others, so that the load generator never takes an arm's CPU")
	fs.DurationVar(&f.probe, "probe", 1500*time.Millisecond, "time measured at each offered rate, after a warm-up of a fifth of it")
	fs.DurationVar(&f.backend, "backend", 20*time.Millisecond, "the simulated backend's time per non-streamed request")
	fs.DurationVar(&f.pace, "pace", 50*time.Millisecond, "token pace of the streams (a stall is a gap over ten of it)")
	fs.IntVar(&f.tokens, "tokens", 16, "tokens per stream")
	fs.Float64Var(&f.minRate, "min-rate", 100, "first offered rate of the frontier search (requests/s)")
	fs.Float64Var(&f.maxRate, "max-rate", 40000, "highest offered rate tried")
	fs.Float64Var(&f.factor, "factor", 1.25, "ratio between successive offered rates")
	fs.Float64Var(&f.cpuRate, "cpu-rate", 1000, "offered rate at which CPU per request is read")
	fs.Float64Var(&f.burst, "burstiness", 1, "the frontier search's arrivals: gamma-distributed gaps of this shape at the offered rate; 1 is Poisson, below 1 arrivals come in bursts (0.25: gaps spread twice their mean)")
	fs.IntVar(&f.idle, "idle", 2000, "idle streams held at once for the memory figure (0: skip it)")
	levelsSpec := fs.String("levels", "256,512,1024,2048,4096,8192", "concurrent streams tried for the stream ceiling, in order")
	limitsSpec := fs.String("limits", "1,5,10", "added p99 limits of the frontier, in ms")
	armsSpec := fs.String("arms", "", "only these arms, comma-separated (direct always runs); empty: all")
	fs.BoolVar(&f.costs, "costs", true, "also measure what each of tokentap's measuring features costs (A/B of tokentap variants)")
	fs.StringVar(&f.trace, "trace", "", "rates (lo-hi, requests/s) at which the tokentap arm's first probe is traced: an execution trace from its admin (runtime/trace) beside results, tokentap-<rate>.trace; empty: none")
	render := fs.Bool("render", false, "only rewrite results.md and frontier.svg of -out from its results.json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *render {
		return rerenderFrontier(f.outDir, out)
	}
	var err error
	if f.levels, err = parseLevels(*levelsSpec); err != nil {
		return err
	}
	for _, s := range strings.Split(*limitsSpec, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || v <= 0 {
			return fmt.Errorf("-limits: %q is not a positive number of ms", s)
		}
		f.limits = append(f.limits, v)
	}
	slices.Sort(f.limits)
	if f.factor <= 1 || f.minRate <= 0 || f.maxRate < f.minRate || f.rounds < 1 || !(f.burst > 0) || f.probes < 1 {
		return fmt.Errorf("need -factor > 1, 0 < -min-rate ≤ -max-rate, -rounds ≥ 1, -probes ≥ 1 and -burstiness > 0")
	}
	f.only = armSet(*armsSpec)
	if err := os.MkdirAll(f.outDir, 0o755); err != nil {
		return err
	}
	raiseFileLimit()
	b := benchSettings{outDir: f.outDir, bin: f.bin}
	if err := b.buildBinaries(); err != nil {
		return err
	}
	f.bin = b.bin
	rep, err := f.run()
	if err != nil {
		return err
	}
	return writeFrontier(f.outDir, rep, out)
}

// run starts the backend and the arms, measures round after round, and
// derives the figures.
func (f *frontierSettings) run() (*frontierReport, error) {
	var procs []func()
	defer func() {
		for i := len(procs) - 1; i >= 0; i-- {
			procs[i]()
		}
	}()
	// One backend for every phase: each request's path sets its timing
	// (mockllm's /_mock/PREFILL/GAP/), so that no arm's pooled upstream
	// connections die with a restarted backend.
	f.mockAddr = freePort()
	mock, err := startProc(f.outDir, "mockllm", filepath.Join(f.bin, "mockllm"), nil,
		"-listen", f.mockAddr, "-prefill-per-token", "0", "-jitter", "0.2", "-stamp")
	if err != nil {
		return nil, err
	}
	procs = append(procs, func() { stop(mock) })
	if err := waitReady("http://" + f.mockAddr + "/"); err != nil {
		return nil, err
	}
	f.clients = map[string]*client{}
	defer f.closeAll()
	rep := &frontierReport{Machine: machine(), Skipped: map[string]string{}, IdleRSS: map[string]float64{}, Tried: gatewaysTried()}
	arms, stopArms, err := f.startArms(rep)
	procs = append(procs, stopArms)
	if err != nil {
		return nil, err
	}
	rep.Settings = map[string]any{"gomaxprocs": f.gmp, "rounds": f.rounds, "probe_s": f.probe.Seconds(), "backend_ms": ms(f.backend),
		"pace_ms": ms(f.pace), "tokens_per_stream": f.tokens, "min_rate": f.minRate, "max_rate": f.maxRate, "factor": f.factor,
		"limits_ms": f.limits, "levels": f.levels, "cpu_rate": f.cpuRate, "idle_streams": f.idle, "arrivals": f.arrivals()}
	for _, a := range arms {
		rep.Arms = append(rep.Arms, a.Name)
	}
	// Memory first, on processes that have served nothing yet: after the
	// load phases a heap keeps what it grew to, and idle streams would
	// fit in it unseen.
	f.idleMemory(arms, rep)
	if f.pin {
		if err := f.pinArms(arms, mock.Process.Pid); err != nil {
			return nil, fmt.Errorf("-pin: %w", err)
		}
		rep.Settings["pinned"] = fmt.Sprintf("the arms on CPU %d; the load generator and the backend on the others", runtime.NumCPU()-1)
	}
	for r := 0; r < f.rounds; r++ {
		fmt.Fprintf(os.Stderr, "round %d of %d\n", r+1, f.rounds)
		var round frontierRound
		small, streams := f.phase(arms, f.smallPath()), f.phase(arms, f.streamPath())
		f.warmAll(small)
		round.OneClient = f.oneClient(small, r)
		round.Sweep, round.DirectCap = f.sweep(small, r)
		round.CPU = f.cpuAtRate(small, r)
		f.closeAll()
		round.Streams = f.streams512(streams, r)
		round.Ceiling = f.ceiling(streams, r)
		rep.Rounds = append(rep.Rounds, round)
	}
	if f.costs {
		if err := f.featureCosts(rep); err != nil {
			return nil, err
		}
	}
	return rep, nil
}

// idleMemory reads each arm's memory per 1,000 idle streams into rep.
func (f *frontierSettings) idleMemory(arms []*arm, rep *frontierReport) {
	if f.idle > 0 {
		fmt.Fprintf(os.Stderr, "memory: %d idle streams per arm\n", f.idle)
		for _, a := range arms {
			if a.pids == nil || a.Name == "fasthttp-relay" || strings.HasPrefix(a.URL, "h2c://") {
				// fasthttp's client hands a streamed body on in reads
				// of its buffer's size: the bare relay holds a stream's
				// first event until more bytes come, and an idle stream
				// never opens through it. The idle streams are HTTP/1.1
				// connections: not an HTTP/2 arm's.
				continue
			}
			// Two tokens a minute apart: the streams end by themselves
			// after the figure is read, in every arm alike.
			mb, err := idleRSS(f.at(a, idlePath), f.idle, idleBody)
			if err != nil {
				fmt.Fprintf(os.Stderr, "%s: idle streams: %v\n", a.Name, err)
				continue
			}
			rep.IdleRSS[a.Name] = mb
		}
	}
}

// startArms starts every arm that can run here, each pointed at the
// backend, and records those that cannot in rep.Skipped.
func (f *frontierSettings) startArms(rep *frontierReport) ([]*arm, func(), error) {
	var arms []*arm
	stopAll := func() {
		for i := len(arms) - 1; i >= 0; i-- {
			stop(arms[i].cmd)
		}
	}
	upstream := "http://" + f.mockAddr
	arms = append(arms, &arm{Name: "direct", URL: upstream + "/v1/chat/completions"})
	want := func(name string) bool { return f.only == nil || f.only[name] }
	starts := []struct {
		name string
		fn   func() (*arm, error)
	}{
		{"tokentap", func() (*arm, error) {
			return startTokentapVariant(f.outDir, "tokentap", f.bin, f.gmp, upstream, variantAll, "")
		}},
		{"nginx", func() (*arm, error) { return f.nginxArm(false) }},
		// HTTP/2 arms: clients over h2c, each request a stream of a
		// connection the client's transport shares among its requests.
		{"tokentap-h2", func() (*arm, error) {
			a, err := startTokentapVariant(f.outDir, "tokentap-h2", f.bin, f.gmp, upstream, variantAll, "")
			if err == nil {
				a.URL = "h2c://" + strings.TrimPrefix(a.URL, "http://")
			}
			return a, err
		}},
		{"nginx-h2", func() (*arm, error) { return f.nginxArm(true) }},
		{"haproxy", func() (*arm, error) {
			if _, err := os.Stat(f.haproxyBin); f.haproxyBin == "" || err != nil {
				return nil, fmt.Errorf("no HAProxy binary at %q", f.haproxyBin)
			}
			return startHAProxy(f.outDir, f.haproxyBin, f.mockAddr, f.gmp)
		}},
		{"go-relay", func() (*arm, error) { return startGoRelay(f.outDir, "go-relay", "relay", f.gmp, f.mockAddr) }},
		{"fasthttp-relay", func() (*arm, error) {
			return startGoRelay(f.outDir, "fasthttp-relay", "fasthttp-relay", f.gmp, f.mockAddr)
		}},
		{"portkey", func() (*arm, error) { return startPortkey(f.outDir, f.jsRuntime, f.portkeyJS, f.mockAddr) }},
	}
	for _, s := range starts {
		if !want(s.name) {
			continue
		}
		a, err := s.fn()
		if err == nil {
			err = waitReady(a.URL)
			if err != nil {
				stop(a.cmd)
			}
		}
		if err != nil {
			rep.Skipped[s.name] = err.Error()
			fmt.Fprintf(os.Stderr, "%s: not measured: %v\n", s.name, err)
			continue
		}
		arms = append(arms, a)
	}
	// A request through each: an arm that cannot relay is not measured.
	for i := 1; i < len(arms); i++ {
		a := arms[i]
		if err := probeArm(a); err != nil {
			rep.Skipped[a.Name] = err.Error()
			fmt.Fprintf(os.Stderr, "%s: not measured: %v\n", a.Name, err)
			stop(a.cmd)
			arms = slices.Delete(arms, i, i+1)
			i--
		}
	}
	return arms, stopAll, nil
}

// nginxArm starts the nginx arm (h2: its clients over h2c).
func (f *frontierSettings) nginxArm(h2 bool) (*arm, error) {
	if _, err := os.Stat(f.nginxBin); f.nginxBin == "" || err != nil {
		return nil, fmt.Errorf("no nginx binary at %q", f.nginxBin)
	}
	return startNginx(f.outDir, f.nginxBin, f.mockAddr, f.gmp, h2)
}

// probeArm sends one streamed request through a and checks its tokens.
func probeArm(a *arm) error {
	cl, err := newClient(a.URL, a.Headers, 10*time.Second, nil)
	if err != nil {
		return err
	}
	defer cl.closeIdle()
	var last result
	for range 20 { // a gateway may take a moment after it listens
		last = cl.do("probe", []byte(`{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`), true)
		if last.Err == "" && last.Status == 200 && len(last.Tokens) == 4 {
			return nil
		}
		time.Sleep(250 * time.Millisecond)
	}
	return fmt.Errorf("a streamed request through it: status %d, %d of 4 tokens, error %q", last.Status, len(last.Tokens), last.Err)
}

// gatewaysTried says which LLM gateways were tried as arms, and how.
func gatewaysTried() map[string]string {
	return map[string]string{
		"portkey": "npm @portkey-ai/gateway (1.15.2 and 1.9.8): on Node 20 and Node 22 every streamed response fails (\"Something went wrong\"); on Bun both relay streams, so the arm runs it on Bun (-js-runtime)",
		"bifrost": "its npm package downloads its binary at run time (no internet here); its Go modules (github.com/maximhq/bifrost/core, /transports) are not served by the module proxy",
		"go":      "no Go LLM gateway module is served here: github.com/maximhq/bifrost, github.com/songquanpeng/one-api, github.com/QuantumNous/new-api and github.com/envoyproxy/ai-gateway were refused by the module proxy",
		"litellm": "Python: PyPI cannot be reached from this machine",
	}
}

// startPortkey runs Portkey's gateway on runtime as a plain
// OpenAI-compatible pass-through to upstream (host:port): the provider
// openai, the backend as its custom host, sent with every request.
func startPortkey(dir, runtime, js, upstream string) (*arm, error) {
	if js == "" {
		return nil, fmt.Errorf("not asked for (-portkey: the path of @portkey-ai/gateway's build/start-server.js)")
	}
	if _, err := os.Stat(js); err != nil {
		return nil, err
	}
	addr := freePort()
	_, port, _ := net.SplitHostPort(addr)
	// Bun's fetch opens at most 256 connections at once unless told
	// (BUN_CONFIG_MAX_HTTP_REQUESTS): past that, streams would wait for
	// one another instead of measuring the gateway.
	cmd, err := startProc(dir, "portkey", runtime, []string{"NODE_ENV=production", "BUN_CONFIG_MAX_HTTP_REQUESTS=65535"}, js, "--port="+port, "--headless")
	if err != nil {
		return nil, err
	}
	return &arm{Name: "portkey", URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: withChildren(cmd),
		Headers: map[string]string{"x-portkey-provider": "openai", "x-portkey-custom-host": "http://" + upstream + "/v1", "Authorization": "Bearer bench"}}, nil
}

// minProbeRequests is the fewest requests a rate of the search is
// measured on (four beyond the p99).
const minProbeRequests = 400

// rates is the offered rates of the search.
func (f *frontierSettings) rates() []float64 {
	var out []float64
	for r := f.minRate; r <= f.maxRate*1.0001; r *= f.factor {
		out = append(out, math.Round(r))
	}
	return out
}

// The backend's timing per phase, in the request's path (mockllm).
const (
	idlePath = "/_mock/1ms/60s"
	idleBody = `{"model":"m","stream":true,"max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`
)

func (f *frontierSettings) smallPath() string  { return "/_mock/" + f.backend.String() + "/0s" }
func (f *frontierSettings) streamPath() string { return "/_mock/1ms/" + f.pace.String() }

// at is arm a with the backend's timing of one phase in its requests'
// path: in the URL, or for a gateway told the backend by a header, in
// that header.
func (f *frontierSettings) at(a *arm, path string) *arm {
	b := *a
	if _, ok := a.Headers["x-portkey-custom-host"]; ok {
		b.Headers = maps.Clone(a.Headers)
		b.Headers["x-portkey-custom-host"] = "http://" + f.mockAddr + path + "/v1"
	} else {
		b.URL = strings.Replace(a.URL, "/v1/chat/completions", path+"/v1/chat/completions", 1)
	}
	return &b
}

func (f *frontierSettings) phase(arms []*arm, path string) []*arm {
	out := make([]*arm, len(arms))
	for i, a := range arms {
		out[i] = f.at(a, path)
	}
	return out
}

// client is the arm's client, kept (with its connections) across rounds.
func (f *frontierSettings) client(a *arm) *client {
	key := a.Name + " " + a.URL + " " + a.Headers["x-portkey-custom-host"]
	if cl := f.clients[key]; cl != nil {
		return cl
	}
	cl, err := newClient(a.URL, a.Headers, time.Minute, nil)
	if err != nil {
		panic(err) // the arms' URLs are made here
	}
	f.clients[key] = cl
	return cl
}

// arrivals names the frontier search's arrivals.
func (f *frontierSettings) arrivals() string {
	if f.burst == 1 {
		return "Poisson (open loop)"
	}
	return fmt.Sprintf("gamma gaps of shape %g, bursts around the offered rate (open loop)", f.burst)
}

func smallPlan(a *arm, cl *client, rate float64, d time.Duration, id string) plan {
	return plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Rate: rate, Burstiness: 1, Duration: d,
		Timeout: 30 * time.Second, IDPrefix: id, Client: cl, MaxInflight: 4096}
}

// warmAll opens each arm's connections (to it and from it upstream).
func (f *frontierSettings) warmAll(arms []*arm) {
	for _, a := range arms {
		run(smallPlan(a, f.client(a), 200, 500*time.Millisecond, "w-"+a.Name+"-"))
	}
}

func (f *frontierSettings) closeAll() {
	for _, cl := range f.clients {
		cl.closeIdle()
	}
}

// oneClient measures each arm with one client, one request after the
// other, for 4 probes' time.
func (f *frontierSettings) oneClient(arms []*arm, r int) map[string]roundStat {
	out := map[string]roundStat{}
	fmt.Fprintln(os.Stderr, "one client")
	for i := range arms {
		a := arms[(i+r)%len(arms)]
		p := plan{URL: a.URL, Model: "m", Workloads: []workload{workloads["tiny"]}, Concurrency: 1, Duration: 4 * f.probe,
			Timeout: 30 * time.Second, IDPrefix: fmt.Sprintf("c1-%s-%d-", a.Name, r), Client: f.client(a)}
		out[a.Name], _ = measure(a, p)
	}
	return out
}
