package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/tokentap/tokentap/examples/mockllm"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy"
	"go.uber.org/zap"
)

// runDemo starts the simulated backend and tokentap in front of it on
// loopback, with SLOs, sends a burst of mixed traffic through tokentap, and
// prints what tokentap measured per route, the goodput and the warnings.
// With -serve it then keeps the traffic going and serves the admin
// listener (the dashboard at /) until ctx ends.
func runDemo(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap demo", flag.ContinueOnError)
	n := fs.Int("requests", 120, "requests to send")
	conc := fs.Int("concurrency", 12, "requests in flight at once")
	logPath := fs.String("access-log", "", "also write the access log here (- for stdout)")
	serve := fs.String("serve", "", "then keep sending traffic and serve the dashboard and /stats on this admin address (e.g. 127.0.0.1:9090) until interrupted")
	liveConc := fs.Int("live", -1, "with -serve: requests in flight while serving (default: -concurrency; 0: none)")
	canary := fs.Bool("canary", false, "split the chat route 90/10 between the backend and a canary that batches harder (longer prefill, faster decode) and print the verdict")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *liveConc < 0 {
		*liveConc = *conc
	}
	if *n <= 0 || *conc <= 0 {
		return fmt.Errorf("-requests and -concurrency must be positive")
	}
	var adminLn net.Listener
	if *serve != "" {
		var err error
		if adminLn, err = net.Listen("tcp", *serve); err != nil {
			return fmt.Errorf("-serve: %w", err)
		}
		defer adminLn.Close()
	}

	backendLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	// Continuous batching: more streams at once raise throughput and
	// every stream's latency, as on a real server.
	backend := &http.Server{Handler: mockllm.New(mockllm.Options{
		PrefillBase: 30 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, TokenGap: 8 * time.Millisecond, BatchSlowdown: 0.03,
	})}
	go func() { _ = backend.Serve(backendLn) }()
	defer backend.Close()
	upstream := "http://" + backendLn.Addr().String()
	chat := proxy.Route{Name: "chat", Prefix: "/v1/chat/", Upstream: upstream, Timeouts: proxy.DefaultTimeouts, InjectUsage: true, SLO: metrics.SLO{TTFT: 150 * time.Millisecond}}
	if *canary {
		// Batching harder: prefill waits for a fuller batch, decode runs
		// more tokens per step.
		canaryLn, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		cb := &http.Server{Handler: mockllm.New(mockllm.Options{
			PrefillBase: 45 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, TokenGap: 7 * time.Millisecond, BatchSlowdown: 0.03,
		})}
		go func() { _ = cb.Serve(canaryLn) }()
		defer cb.Close()
		chat.Upstream = ""
		chat.Upstreams = []proxy.Upstream{{Name: "stable", URL: upstream, Weight: 90}, {Name: "canary", URL: "http://" + canaryLn.Addr().String(), Weight: 10}}
		// The guard weighs a minute of traffic once a whole minute passed
		// (with -serve): a canary 20% worse on TTFT or E2E p95 is stopped.
		chat.Guard = &proxy.Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 30, MaxTTFTP95Increase: 0.2, MaxE2EP95Increase: 0.2}
	}

	col := &counter{}
	sinks := []metrics.Sink{col}
	if *logPath != "" {
		alog, err := metrics.OpenAccessLog(*logPath, 0)
		if err != nil {
			return err
		}
		defer alog.Close()
		sinks = append(sinks, alog)
	}
	t := proxy.DefaultTimeouts
	p, err := proxy.New(proxy.Config{
		Routes: []proxy.Route{
			// Chat users expect the first word fast.
			chat,
			{Name: "completions", Prefix: "/v1/completions", Upstream: upstream, Timeouts: t},
			{Name: "anthropic", Prefix: "/v1/messages", Upstream: upstream, Timeouts: t},
			{Name: "ollama", Prefix: "/api/", Upstream: upstream, Timeouts: t},
		},
		Models: []string{"demo-small", "demo-large"},
		SLO:    metrics.SLO{TTFT: 300 * time.Millisecond, TPOT: 25 * time.Millisecond, E2E: 5 * time.Second, Target: 0.95},
	}, proxy.Options{Sinks: sinks})
	if err != nil {
		return err
	}
	defer p.Close()
	ln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = p.Serve(ln) }()
	defer func() { _ = p.Shutdown(context.Background()) }()
	base := "http://" + ln.Addr().String()
	fmt.Fprintf(out, "simulated backend on %s, tokentap on %s\n"+
		"SLOs: TTFT 300 ms (chat: 150 ms), TPOT 25 ms, E2E 5 s; goodput target 95%%\n"+
		"sending %d requests, %d at a time...\n\n", upstream, base, *n, *conc)

	// The mix: short chats, long prompts with short answers, long outputs,
	// a reasoning model, non-streamed chats, streamed completions, and the
	// Anthropic and Ollama dialects.
	long := strings.Repeat("lorem ipsum dolor sit amet ", 400)
	mix := []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"demo-small","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":8,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"` + long + `"}]}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":64,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"write"}]}`},
		{"/v1/chat/completions", `{"model":"demo-small","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/completions", `{"model":"demo-small","stream":true,"max_tokens":24,"prompt":"once upon a time"}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":16,"mock_reasoning_tokens":24,"messages":[{"role":"user","content":"why?"}]}`},
		{"/v1/messages", `{"model":"demo-large","stream":true,"max_tokens":24,"mock_reasoning_tokens":8,"messages":[{"role":"user","content":"hi"}]}`},
		{"/api/chat", `{"model":"demo-small","options":{"num_predict":24},"messages":[{"role":"user","content":"hi"}]}`},
	}
	client := &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: *conc}}
	send := func(i int64) bool {
		m := mix[i%int64(len(mix))]
		resp, err := client.Post(base+m.path, "application/json", strings.NewReader(m.body))
		if err != nil {
			return false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return true
	}
	var next atomic.Int64
	var failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range *conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(*n) {
					return
				}
				if !send(i) {
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	col.wait(*n - int(failed.Load()))
	groupBy := []string{"route"}
	if *canary {
		groupBy = append(groupBy, "upstream")
	}
	printStats(out, p.Stats().Query(stats.Query{Window: "all", GroupBy: groupBy}))
	if *canary {
		fmt.Fprintln(out)
		c, err := p.Stats().Compare("chat", "stable", "canary", "all", 0)
		if err != nil {
			fmt.Fprintln(out, "no verdict:", err)
		} else {
			printComparison(out, c)
		}
		fmt.Fprintln(out, "guard: stops the canary when its TTFT or E2E p95 is 20% above stable's over a minute; it weighs once a whole minute passed (keep it running with -serve, and watch /stats)")
	}
	fmt.Fprintf(out, "\n%d requests in %v (%d client errors). Times in ms at tokentap's client side; TTFT is the first\n"+
		"token of any kind, TTFA the first answer token (reasoning models wait between the two); ITL is every\n"+
		"gap between tokens. Goodput: the share of requests that met every SLO of their route.\n",
		*n, wall.Round(time.Millisecond), failed.Load())
	if adminLn == nil {
		fmt.Fprintln(out, "Per-request records: add -access-log -. A live dashboard: add -serve 127.0.0.1:9090.")
		return nil
	}

	// Serve: the dashboard, /stats and /metrics, with traffic going on.
	logger := zap.NewNop()
	a := &admin{logger: logger, p: p, running: &settings{}}
	a.ready.Store(true)
	srv := a.server()
	go func() { _ = srv.Serve(newAdminListener(adminLn)) }()
	defer func() { _ = srv.Shutdown() }()
	fmt.Fprintf(out, "\ndashboard: http://%s/   stats: http://%s/stats   metrics: http://%s/metrics\n"+
		"traffic keeps flowing (up to %d at a time, rising and falling); Ctrl-C stops.\n", adminLn.Addr(), adminLn.Addr(), adminLn.Addr(), *liveConc)
	var live sync.WaitGroup
	for w := range *liveConc {
		live.Add(1)
		go func() {
			defer live.Done()
			for ctx.Err() == nil {
				// Load rises and falls over two minutes: half the workers
				// pause in the quiet half, so throughput and TTFT move together.
				if w%2 == 1 && time.Now().Unix()/60%2 == 0 {
					select {
					case <-ctx.Done():
					case <-time.After(time.Second):
					}
					continue
				}
				send(next.Add(1))
			}
		}()
	}
	<-ctx.Done()
	client.CloseIdleConnections()
	live.Wait()
	return nil
}

// counter counts the demo's records, to wait for the last.
type counter struct{ n atomic.Int64 }

func (c *counter) Observe(*metrics.Record) { c.n.Add(1) }

func (c *counter) wait(n int) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) && c.n.Load() < int64(n) {
		time.Sleep(10 * time.Millisecond)
	}
}

// printStats prints a /stats report as a table, then its warnings.
func printStats(out io.Writer, rep stats.Report) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "route\tmodel\ttenant\tcount\terrors\tgoodput\tTTFT p50\tp95\tp99\tTTFA p50\tp99\tITL p50\tp95\tp99\tE2E p50\tp95\tp99\tqueue p95\toverhead p95\ttokens/s\t")
	for _, g := range rep.Groups {
		good := "-"
		if g.Goodput.Ratio != nil {
			good = fmt.Sprintf("%.1f%%", 100**g.Goodput.Ratio)
		}
		f := func(d stats.Dist, v float64) string {
			if d.Count == 0 {
				return "-"
			}
			return fmt.Sprintf("%.1f", v)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t\n",
			dash(g.Route), dash(g.Model), dash(g.Tenant), g.Count, g.Errors, good,
			f(g.TTFT, g.TTFT.P50), f(g.TTFT, g.TTFT.P95), f(g.TTFT, g.TTFT.P99), f(g.TTFA, g.TTFA.P50), f(g.TTFA, g.TTFA.P99),
			f(g.ITL, g.ITL.P50), f(g.ITL, g.ITL.P95), f(g.ITL, g.ITL.P99), f(g.E2E, g.E2E.P50), f(g.E2E, g.E2E.P95), f(g.E2E, g.E2E.P99),
			f(g.Queue, g.Queue.P95), f(g.Overhead, g.Overhead.P95), g.OutputTokensPerS)
	}
	_ = tw.Flush()
	for _, g := range rep.Groups {
		if line := waitSplit(g); line != "" {
			fmt.Fprintln(out, line)
		}
	}
	if len(rep.Warnings) == 0 {
		fmt.Fprintln(out, "\nwarnings: none")
		return
	}
	fmt.Fprintln(out, "\nwarnings:")
	for _, w := range rep.Warnings {
		fmt.Fprintf(out, "  [%s] %s\n", w.Kind, w.Message)
	}
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// waitSplit says where a group's users waited for their first token
// (medians): in all, in the network, and in tokentap; "" without the
// client's side.
func waitSplit(g stats.Group) string {
	if g.ClientTTFT.Count == 0 || g.TTFT.Count == 0 {
		return ""
	}
	who := "route " + g.Route
	if g.Model != "" {
		who += ", model " + g.Model
	}
	if g.Tenant != "" {
		who += ", tenant " + g.Tenant
	}
	return fmt.Sprintf("%s: users waited %.1f ms for the first token (p50), %.1f of them in the network, %.2f in tokentap",
		who, g.ClientTTFT.P50, max(g.ClientTTFT.P50-g.TTFT.P50, 0), g.Overhead.P50)
}
