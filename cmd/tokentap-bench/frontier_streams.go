package main

// The frontier's stream phases: CPU per request at a fixed rate, TTFT with
// 512 streams in flight, the stream ceiling, memory per idle stream.

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"
)

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
