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
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
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
	if f.idle > 0 {
		fmt.Fprintf(os.Stderr, "memory: %d idle streams per arm\n", f.idle)
		for _, a := range arms {
			if a.pids == nil || a.Name == "fasthttp-relay" {
				// fasthttp's client hands a streamed body on in reads
				// of its buffer's size: the bare relay holds a stream's
				// first event until more bytes come, and an idle stream
				// never opens through it.
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
		{"nginx", func() (*arm, error) {
			if _, err := os.Stat(f.nginxBin); f.nginxBin == "" || err != nil {
				return nil, fmt.Errorf("no nginx binary at %q", f.nginxBin)
			}
			return startNginx(f.outDir, f.nginxBin, f.mockAddr, f.gmp)
		}},
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

// aaControl is the name of the A/A control of the sweep: direct, measured
// again as if it were an arm. What it adds to direct is the instrument's
// own noise at that rate.
const aaControl = "direct A/A"

// sweep offers each rate in turn, f.probes times, to direct, the A/A
// control and every arm still going, interleaved in an order rotated each
// probe. An arm's point at a rate is the median of its probes' added p99s
// (each its p99 less direct's in the same probe); the rate's noise band is
// the control's median added p99, in absolute value. An arm stops at its
// second rate in a row past the largest limit (a rate whose band is itself
// past it counts for nothing), or at its first not held in most probes; all stop where direct itself is not
// held twice (the load generator's and the backend's ceiling).
func (f *frontierSettings) sweep(arms []*arm, r int) (map[string][]ratePoint, float64) {
	out := map[string][]ratePoint{}
	going, over := map[string]bool{}, map[string]bool{}
	for _, a := range arms {
		going[a.Name] = true
	}
	control := *arms[0]
	control.Name = aaControl
	all := append(slices.Clone(arms), &control)
	going[aaControl] = true
	lim := f.limits[len(f.limits)-1]
	capRate := 0.0
	for k, rate := range f.rates() {
		fmt.Fprintf(os.Stderr, "offered %.0f/s:", rate)
		// A p99 needs requests beyond it: at low rates the probe lasts
		// long enough for minProbeRequests.
		probe := max(f.probe, time.Duration(minProbeRequests/rate*float64(time.Second)))
		probes := map[string][]ratePoint{}
		directHeld := true
		for n := 0; n < f.probes && directHeld; n++ {
			retried := false
			order := rotate(all, k+r+n)
			direct := ratePoint{}
			got := map[string]ratePoint{}
			for i := 0; i < len(order); i++ {
				a := order[i]
				if !going[a.Name] {
					continue
				}
				p := f.probeAt(a, rate, probe, fmt.Sprintf("f-%s-%d-%.0f-%d-", strings.ReplaceAll(a.Name, " ", ""), r, rate, n))
				if a.Name == "direct" {
					// Past this the load generator or the backend is the
					// bottleneck: added figures would measure them. A
					// stall of either in one probe is not its ceiling:
					// direct is measured once more before the search ends.
					p.Held = p.Held && p.P99 <= ms(f.backend)+lim
					if !p.Held && !retried {
						retried = true
						fmt.Fprintf(os.Stderr, " direct p99 %.1fms, again", p.P99)
						i--
						continue
					}
					direct = p
				}
				got[a.Name] = p
			}
			for name, p := range got {
				if name != "direct" {
					p.Added = p.P99 - direct.P99
				}
				probes[name] = append(probes[name], p)
			}
			directHeld = direct.Held
		}
		band := math.Abs(median(addedOf(probes[aaControl])))
		pts := map[string]ratePoint{}
		for _, a := range all {
			ps := probes[a.Name]
			if len(ps) == 0 {
				continue
			}
			p := mergeProbes(ps)
			p.Band = band
			pts[a.Name] = p
			out[a.Name] = append(out[a.Name], p)
			if a.Name != "direct" {
				fmt.Fprintf(os.Stderr, " %s %+.2fms [%+.1f…%+.1f]", a.Name, p.Added, slices.Min(p.Probes), slices.Max(p.Probes))
			}
			// An arm stops at its second rate in a row past the largest
			// limit (one alone may still be noise; one where the control
			// itself is past it tells nothing), or at once when it fell
			// behind.
			switch {
			case a.Name == aaControl:
				// The control goes on as long as direct does.
			case !p.Held:
				going[a.Name] = false
			case p.Added > lim && band <= lim:
				if over[a.Name] {
					going[a.Name] = false
				}
				over[a.Name] = true
			default:
				over[a.Name] = false
			}
		}
		fmt.Fprintf(os.Stderr, " (band %.2fms)\n", band)
		if !pts["direct"].Held {
			break
		}
		capRate = rate
		if !slices.ContainsFunc(arms[1:], func(a *arm) bool { return going[a.Name] }) {
			break
		}
	}
	return out, capRate
}

// pinArms puts every arm's processes on the last CPU and this program and
// the backend (its pid; 0 or less: already placed) on the others: the load generator's work and its pauses
// never take the CPU an arm runs on, and every arm has the same one.
func (f *frontierSettings) pinArms(arms []*arm, backend int) error {
	last := runtime.NumCPU() - 1
	var others []int
	for c := range last {
		others = append(others, c)
	}
	own := []int{os.Getpid()}
	if backend > 0 {
		own = append(own, backend)
	}
	if err := pinTasks(own, others); err != nil {
		return err
	}
	for _, a := range arms {
		if a.pids == nil {
			continue
		}
		if err := pinTasks(a.pids(), []int{last}); err != nil {
			return fmt.Errorf("%s: %w", a.Name, err)
		}
	}
	return nil
}

// probeAt measures arm a once at rate for probe, after a warm-up of a
// fifth of f.probe. The load generator's garbage collector is held off
// while it measures (collected just before): its pauses are not the
// arm's.
func (f *frontierSettings) probeAt(a *arm, rate float64, probe time.Duration, id string) ratePoint {
	cl := f.client(a)
	warm, plan := smallPlan(a, cl, rate, f.probe/5, "wu-"), smallPlan(a, cl, rate, probe, id)
	warm.Burstiness, plan.Burstiness = f.burst, f.burst
	run(warm)
	runtime.GC()
	old := debug.SetGCPercent(-1)
	tr := f.traceDuring(a, rate, probe, id)
	st, _ := measure(a, plan)
	debug.SetGCPercent(old)
	tr()
	p := ratePoint{Offered: rate, Requests: st.Requests, Errors: st.Errors, P50: st.E2Ep50, P99: st.E2Ep99,
		Achieved: float64(st.Requests) / probe.Seconds()}
	// Held, and not behind: the last answers came within a second (and
	// half the probe) of the last arrival.
	p.Held = held(rate, probe, f.burst, st.Requests+st.Errors, p.Errors) && st.Seconds <= 1.5*probe.Seconds()+1
	return p
}

// traceDuring starts an execution trace of tokentap arm a for d when rate
// is within -trace and this is its first probe there (id ends "-0-"), and
// returns what waits for it to be written.
func (f *frontierSettings) traceDuring(a *arm, rate float64, d time.Duration, id string) func() {
	var lo, hi float64
	if f.trace == "" || a.Admin == "" || !strings.HasSuffix(id, "-0-") {
		return func() {}
	}
	if n, _ := fmt.Sscanf(f.trace, "%g-%g", &lo, &hi); n != 2 || rate < lo || rate > hi {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		url := fmt.Sprintf("http://%s/debug/pprof/trace?seconds=%d", a.Admin, max(1, int(d.Seconds())))
		resp, err := http.Get(url)
		if err != nil {
			fmt.Fprintf(os.Stderr, " (trace: %v)", err)
			return
		}
		defer resp.Body.Close()
		path := filepath.Join(f.outDir, fmt.Sprintf("%s-%.0f.trace", strings.ReplaceAll(a.Name, " ", ""), rate))
		out, err := os.Create(path)
		if err == nil {
			_, err = io.Copy(out, resp.Body)
			out.Close()
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, " (trace: %v)", err)
		}
	}()
	return func() { <-done }
}

func addedOf(ps []ratePoint) []float64 {
	out := make([]float64, len(ps))
	for i, p := range ps {
		out[i] = p.Added
	}
	return out
}

// mergeProbes is an arm's point at a rate from its probes: the medians of
// its figures, each probe's added p99, held when most probes held.
func mergeProbes(ps []ratePoint) ratePoint {
	col := func(f func(ratePoint) float64) float64 {
		v := make([]float64, len(ps))
		for i, p := range ps {
			v[i] = f(p)
		}
		return median(v)
	}
	held := 0
	for _, p := range ps {
		if p.Held {
			held++
		}
	}
	return ratePoint{Offered: ps[0].Offered, Achieved: col(func(p ratePoint) float64 { return p.Achieved }),
		Requests: int(col(func(p ratePoint) float64 { return float64(p.Requests) })), Errors: int(col(func(p ratePoint) float64 { return float64(p.Errors) })),
		P50: col(func(p ratePoint) float64 { return p.P50 }), P99: col(func(p ratePoint) float64 { return p.P99 }),
		Added: col(func(p ratePoint) float64 { return p.Added }), Held: 2*held > len(ps), Probes: addedOf(ps)}
}

// held says whether n answers in d, errs of them errors, kept up with
// arrivals at rate whose gaps are gamma-distributed of shape (1: Poisson):
// no more than 0.1% errors, and no fewer answers than three standard
// deviations under the rate's mean (an arm that falls behind answers fewer
// within the window and the wait that ends it). Such a count's variance
// is its mean over the shape: bursts spread it.
func held(rate float64, d time.Duration, shape float64, n, errs int) bool {
	mean := rate * d.Seconds()
	return float64(n) >= mean-3*math.Sqrt(mean/shape)-1 && float64(errs) <= 0.001*float64(n)
}

func rotate(a []*arm, k int) []*arm {
	if len(a) == 0 {
		return nil
	}
	k %= len(a)
	return append(slices.Clone(a[k:]), a[:k]...)
}

// frontierOf is the highest offered rate of pts (in increasing order) that
// was held within limit ms before two rates in a row were not (a rate
// whose noise band, the A/A control's added p99, is itself past the limit
// is passed over: it cannot tell): a single
// rate past the limit between rates within it is taken for the noise of
// two p99s (the arm's and direct's), and is itself never the frontier.
// capped says the search ended at direct's ceiling (or the last rate
// tried) with the arm still within the limit: its frontier is at least
// the figure.
func frontierOf(pts []ratePoint, limit, directCap float64) (rate float64, capped bool) {
	bad := 0
	for _, p := range pts {
		if p.Offered > directCap {
			return rate, bad == 0
		}
		if p.Held && p.Band > limit {
			continue // the instrument's own noise at this rate is past the limit: it decides nothing
		}
		if !p.Held || p.Added > limit {
			if bad++; bad == 2 {
				return rate, false
			}
			continue
		}
		bad, rate = 0, p.Offered
	}
	return rate, bad == 0
}

// cpuAtRate reads each arm's CPU per request at a fixed offered rate.
func (f *frontierSettings) cpuAtRate(arms []*arm, r int) map[string]roundStat {
	out := map[string]roundStat{}
	fmt.Fprintf(os.Stderr, "CPU at %.0f requests/s\n", f.cpuRate)
	for i := range arms {
		a := arms[(i+r)%len(arms)]
		out[a.Name], _ = measure(a, smallPlan(a, f.client(a), f.cpuRate, 2*f.probe, fmt.Sprintf("cpu-%s-%d-", a.Name, r)))
	}
	return out
}

func (f *frontierSettings) streamPlan(a *arm, cl *client, id string) plan {
	return plan{URL: a.URL, Model: "m", Workloads: []workload{{Name: "stream", PromptBytes: 100, MaxTokens: f.tokens}}, Stream: true,
		Stamped: true, Timeout: time.Minute, IDPrefix: id, Client: cl}
}

// streams512 offers streams by Poisson arrivals at the rate that keeps 512
// in flight on average (Little's law over a stream's length), and reads
// the TTFT of those that started after the first stream's length.
func (f *frontierSettings) streams512(arms []*arm, r int) map[string]roundStat {
	out := map[string]roundStat{}
	length := time.Duration(f.tokens) * f.pace
	rate := 512 / length.Seconds()
	fmt.Fprintf(os.Stderr, "512 streams in flight: %.0f arrivals/s\n", rate)
	for i := range arms {
		a := arms[(i+r)%len(arms)]
		p := f.streamPlan(a, f.client(a), fmt.Sprintf("s512-%s-%d-", a.Name, r))
		p.Rate, p.Burstiness, p.Duration = rate, 1, length+4*f.probe
		cpu0 := cpuSeconds(a)
		res, wall, _ := run(p)
		cpu := cpuSeconds(a) - cpu0
		var start time.Time
		for _, x := range res {
			if start.IsZero() || x.Start.Before(start) {
				start = x.Start
			}
		}
		var ttft, delay []time.Duration
		st := roundStat{Seconds: wall.Seconds(), CPU: cpu}
		for _, x := range res {
			if x.Err != "" || x.Status >= 400 {
				st.Errors++
				continue
			}
			st.Tokens += len(x.Tokens)
			if x.Start.Sub(start) < length || x.TTFT < 0 {
				continue
			}
			st.Requests++
			ttft = append(ttft, x.TTFT)
			delay = append(delay, x.Delays...)
		}
		t, d := newDist(ttft), newDist(delay)
		st.TTFTp50, st.TTFTp99, st.DelayP50, st.DelayP99 = t.P50, t.P99, d.P50, d.P99
		out[a.Name] = st
		f.client(a).closeIdle()
	}
	return out
}

// ceiling raises each arm's concurrent streams level by level (closed
// loop, two streams' length per level) until a stream loses a frame, fails
// or stalls longer than ten token gaps.
func (f *frontierSettings) ceiling(arms []*arm, r int) map[string][]ceilPoint {
	out := map[string][]ceilPoint{}
	length := time.Duration(f.tokens) * f.pace
	for i := range arms {
		a := arms[(i+r)%len(arms)]
		for _, n := range f.levels {
			if 2*n+64 > fileLimit() {
				break
			}
			p := f.streamPlan(a, f.client(a), fmt.Sprintf("ceil-%s-%d-%d-", a.Name, r, n))
			p.Concurrency, p.Duration = n, 2*length
			res, _, _ := run(p)
			f.client(a).closeIdle()
			c := judgeStreams(n, res, f.tokens, 10*f.pace)
			out[a.Name] = append(out[a.Name], c)
			fmt.Fprintf(os.Stderr, "stream ceiling: %s at %d: ok=%v (%d errors, %d short, longest gap %.0f ms)\n", a.Name, n, c.OK, c.Errors, c.Short, c.MaxGapMs)
			if !c.OK {
				break
			}
		}
	}
	return out
}

// judgeStreams checks n concurrent streams' results: every one whole (all
// tokens) with no gap between tokens over stall.
func judgeStreams(n int, res []result, tokens int, stall time.Duration) ceilPoint {
	c := ceilPoint{Streams: n, Started: len(res)}
	var longest time.Duration
	for _, x := range res {
		if x.Err != "" || x.Status >= 400 {
			c.Errors++
			continue
		}
		if len(x.Tokens) < tokens {
			c.Short++
		}
		for _, g := range x.ITL() {
			longest = max(longest, g)
		}
	}
	c.MaxGapMs = ms(longest)
	c.OK = c.Errors == 0 && c.Short == 0 && longest <= stall && c.Started >= n
	return c
}

// ceilingOf is the highest level of pts before the first that failed.
func ceilingOf(pts []ceilPoint) int {
	best := 0
	for _, p := range pts {
		if !p.OK {
			break
		}
		best = p.Streams
	}
	return best
}

// The tokentap variants of the feature-cost A/B: each turns one measuring
// feature off (or, for OTel, on) against variantAll, and one turns every
// switchable one off, which leaves the proxy's own work.
type variant struct {
	Name, What string
	log, slo   bool
	otel       bool
	relay      string
	off        []string // the measurement switches turned off (stats, series, client_side)
}

var (
	variantAll = variant{Name: "tokentap", What: "every measuring feature on: access log, SLO judging, /stats sketches, Prometheus series, client-side TCP_INFO, ACK wait, peer watch; relay loops", log: true, slo: true, relay: "loop"}
	variants   = []variant{
		variantAll,
		{Name: "tokentap-nolog", What: "access log off", slo: true, relay: "loop"},
		{Name: "tokentap-noslo", What: "SLO judging off (no objectives)", log: true, relay: "loop"},
		{Name: "tokentap-otel", What: "OpenTelemetry export on (spans and GenAI metrics to a collector that answers at once)", log: true, slo: true, otel: true, relay: "loop"},
		{Name: "tokentap-nostats", What: "the live /stats sketches off (measurement.stats: false)", log: true, slo: true, relay: "loop", off: []string{"stats"}},
		{Name: "tokentap-noseries", What: "the routes' Prometheus series off (measurement.series: false)", log: true, slo: true, relay: "loop", off: []string{"series"}},
		{Name: "tokentap-noclientside", What: "client-side TCP_INFO and the ACK wait off (measurement.client_side: false)", log: true, slo: true, relay: "loop", off: []string{"client_side"}},
		{Name: "tokentap-nomeasure", What: "every measuring feature with a switch off: access log, SLO judging, /stats sketches, Prometheus series, client-side TCP_INFO and the ACK wait; what is left is the proxy's own work", relay: "loop", off: []string{"stats", "series", "client_side"}},
		{Name: "tokentap-goroutine", What: "streams relayed, and clients watched for their close, on the request's goroutine instead of the epoll relay loops", log: true, slo: true, relay: "goroutine"},
	}
)

// startTokentapVariant runs tokentap from a config file of v's features,
// exporting to otelEndpoint when v has OTel on.
func startTokentapVariant(outDir, name, dir string, gomaxprocs int, upstream string, v variant, otelEndpoint string) (*arm, error) {
	addr, admin := freePort(), freePort()
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "listen: %q\nadmin: %q\nupstream: %q\nrelay: %s\n", addr, admin, upstream, v.relay)
	if v.log {
		logPath, _ := filepath.Abs(filepath.Join(outDir, name+"-access.log"))
		os.Remove(logPath)
		fmt.Fprintf(&cfg, "access_log: %q\n", logPath)
	} else {
		cfg.WriteString("access_log: \"\"\n")
	}
	if v.slo {
		cfg.WriteString("slo: {ttft: 1s, tpot: 100ms, e2e: 30s, target: 99%}\n")
	}
	if len(v.off) > 0 {
		cfg.WriteString("measurement: {" + strings.Join(v.off, ": false, ") + ": false}\n")
	}
	if v.otel && otelEndpoint != "" {
		fmt.Fprintf(&cfg, "otel: {endpoint: %q, service_name: tokentap-bench}\n", otelEndpoint)
	}
	path := filepath.Join(outDir, name+".yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startProc(outDir, name, filepath.Join(dir, "tokentap"), []string{fmt.Sprintf("GOMAXPROCS=%d", gomaxprocs)}, "-config", path)
	if err != nil {
		return nil, err
	}
	return &arm{Name: name, URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: pidsOf(cmd), Admin: admin}, nil
}

// otlpSink answers every OTLP/HTTP export at once with an empty success.
func otlpSink() (string, func(), error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}), ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	return "http://" + ln.Addr().String(), func() { srv.Close() }, nil
}

// featureCosts runs the variants side by side, round after round, and
// reads each one's CPU per request (non-streamed, at -cpu-rate) and per
// token (streams at the token pace, 100 in flight on average).
func (f *frontierSettings) featureCosts(rep *frontierReport) error {
	sink, stopSink, err := otlpSink()
	if err != nil {
		return err
	}
	defer stopSink()
	upstream := "http://" + f.mockAddr
	var arms []*arm
	defer func() {
		for _, a := range arms {
			stop(a.cmd)
		}
	}()
	rep.Variants = map[string]string{}
	for _, v := range variants {
		a, err := startTokentapVariant(f.outDir, "cost-"+v.Name, f.bin, f.gmp, upstream, v, sink)
		if err != nil {
			return err
		}
		a.Name = v.Name
		arms = append(arms, a)
		rep.Variants[v.Name] = v.What
	}
	for _, a := range arms {
		if err := waitReady(a.URL); err != nil {
			return fmt.Errorf("%s: %w", a.Name, err)
		}
	}
	if f.pin {
		if err := f.pinArms(arms, -1); err != nil {
			return fmt.Errorf("-pin: %w", err)
		}
	}
	rep.Costs = map[string][]costStat{}
	length := time.Duration(f.tokens) * f.pace
	small, streams := f.phase(arms, f.smallPath()), f.phase(arms, f.streamPath())
	for r := 0; r <= f.rounds; r++ {
		fmt.Fprintf(os.Stderr, "feature costs: round %d of %d (the first is a warm-up)\n", r, f.rounds)
		per := map[string]costStat{}
		for i := range small {
			a := small[(i+r)%len(small)]
			run(smallPlan(a, f.client(a), f.cpuRate, f.probe/3, "cw-"))
			c := per[a.Name]
			c.PerRequest, _ = measure(a, smallPlan(a, f.client(a), f.cpuRate, 2*f.probe, fmt.Sprintf("cr-%s-%d-", a.Name, r)))
			per[a.Name] = c
		}
		for i := range streams {
			a := streams[(i+r)%len(streams)]
			p := f.streamPlan(a, f.client(a), fmt.Sprintf("ct-%s-%d-", a.Name, r))
			p.Rate, p.Burstiness, p.Duration = 100/length.Seconds(), 1, length+2*f.probe
			c := per[a.Name]
			c.PerToken, _ = measure(a, p)
			per[a.Name] = c
		}
		if r == 0 {
			continue
		}
		for name, c := range per {
			rep.Costs[name] = append(rep.Costs[name], c)
		}
	}
	return nil
}
