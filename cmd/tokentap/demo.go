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

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"go.uber.org/zap"
)

// runDemo starts the simulated backend and tokentap in front of it on
// loopback, with SLOs, sends a burst of mixed traffic through tokentap, and
// prints what tokentap measured per route, the goodput and the warnings.
// With -serve it then keeps the traffic going and serves the admin
// listener (the dashboard at /) until ctx ends.
func runDemo(ctx context.Context, args []string, out io.Writer) error {
	d := &demo{out: out}
	if err := d.parse(args); err != nil {
		return err
	}
	defer d.close()
	if d.overload {
		return runOverloadDemo(ctx, out, 3*time.Second, d.overloadFor)
	}
	fmt.Fprintln(out, "tokentap demo: starting a simulated backend and tokentap in front of it, on loopback...")
	if err := d.start(); err != nil {
		return err
	}
	d.burst()
	d.report()
	if d.adminLn == nil {
		fmt.Fprintln(out, "Per-request records: add -access-log -. A live dashboard: add -serve 127.0.0.1:9090.")
		return nil
	}
	d.serve(ctx)
	return nil
}

// demo is one run of the demo: its flags, what it started (closed in
// reverse order) and its traffic.
type demo struct {
	out                 io.Writer
	n, conc, liveConc   int
	logPath             string
	serveAddr           string
	canary, overload    bool
	overloadFor         time.Duration
	adminLn             net.Listener
	upstream, canaryURL string
	slowURL             string // a backend prefilling four times slower (the completions route's second upstream)
	p                   *proxy.Proxy
	col                 *counter
	base                string
	client              *http.Client
	next, failed        atomic.Int64
	wall                time.Duration
	closers             []func()
}

func (d *demo) parse(args []string) error {
	fs := flag.NewFlagSet("tokentap demo", flag.ContinueOnError)
	fs.IntVar(&d.n, "requests", 120, "requests to send")
	fs.IntVar(&d.conc, "concurrency", 12, "requests in flight at once")
	fs.StringVar(&d.logPath, "access-log", "", "also write the access log here (- for stdout)")
	fs.StringVar(&d.serveAddr, "serve", "", "then keep sending traffic and serve the dashboard and /stats on this admin address (e.g. 127.0.0.1:9090) until interrupted")
	fs.IntVar(&d.liveConc, "live", -1, "with -serve: requests in flight while serving (default: -concurrency; 0: none)")
	fs.BoolVar(&d.canary, "canary", false, "split the chat route 90/10 between the backend and a canary that batches harder (longer prefill, faster decode) and print the verdict (1,000 requests unless -requests says otherwise)")
	fs.BoolVar(&d.overload, "overload", false, "instead: offer twice a simulated server's capacity through tokentap, forwarding everything and then shedding by prediction, and print the goodput of each side by side")
	fs.DurationVar(&d.overloadFor, "overload-for", 10*time.Second, "with -overload: the time measured on each side (after 3 s of warm-up)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if d.overloadFor <= 0 {
		return fmt.Errorf("-overload-for must be positive")
	}
	if d.liveConc < 0 {
		d.liveConc = d.conc
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if d.canary && !set["requests"] {
		// A tenth of the traffic goes to the canary: 1,000 requests give it
		// about 100, enough for the verdict's p50 and p95 rows (a p99 takes
		// 436 a side: its rows say too few).
		d.n = 1000
	}
	if d.n <= 0 || d.conc <= 0 {
		return fmt.Errorf("-requests and -concurrency must be positive")
	}
	return nil
}

// close stops what start started, last first.
func (d *demo) close() {
	for i := len(d.closers) - 1; i >= 0; i-- {
		d.closers[i]()
	}
}

// start opens the admin listener (with -serve), the backends and tokentap.
func (d *demo) start() error {
	if d.serveAddr != "" {
		ln, err := net.Listen("tcp", d.serveAddr)
		if err != nil {
			return fmt.Errorf("-serve: %w", err)
		}
		d.adminLn = ln
		d.closers = append(d.closers, func() { ln.Close() })
	}
	// Continuous batching: more streams at once raise throughput and
	// every stream's latency, as on a real server.
	var err error
	if d.upstream, err = d.backend(mockllm.Options{
		PrefillBase: 30 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, TokenGap: 8 * time.Millisecond, BatchSlowdown: 0.03,
	}); err != nil {
		return err
	}
	// The completions route's second upstream: an older GPU, its prefill
	// four times as long; least_ttft sends it what it serves soonest.
	if d.slowURL, err = d.backend(mockllm.Options{
		PrefillBase: 120 * time.Millisecond, PrefillPerToken: 200 * time.Microsecond, TokenGap: 8 * time.Millisecond, BatchSlowdown: 0.03,
	}); err != nil {
		return err
	}
	if d.canary {
		// Batching harder: prefill waits for a fuller batch, decode runs
		// more tokens per step.
		if d.canaryURL, err = d.backend(mockllm.Options{
			PrefillBase: 45 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, TokenGap: 7 * time.Millisecond, BatchSlowdown: 0.03,
		}); err != nil {
			return err
		}
	}
	return d.startProxy()
}

// backend starts a simulated backend on loopback and returns its URL.
func (d *demo) backend(o mockllm.Options) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: mockllm.New(o)}
	go func() { _ = srv.Serve(ln) }()
	d.closers = append(d.closers, func() { srv.Close() })
	return "http://" + ln.Addr().String(), nil
}

// startProxy starts tokentap on loopback in front of the backends, with
// the demo's routes and SLOs.
func (d *demo) startProxy() error {
	chat := proxy.Route{Name: "chat", Prefix: "/v1/chat/", Upstream: d.upstream, Timeouts: proxy.DefaultTimeouts, InjectUsage: true, SLO: metrics.SLO{TTFT: 150 * time.Millisecond},
		// Overload control predicting (not shedding): what it learns of
		// the backend shows in /stats and on the dashboard.
		Overload: &proxy.Overload{}}
	if d.canary {
		chat.Upstream = ""
		chat.Upstreams = []proxy.Upstream{{Name: "stable", URL: d.upstream, Weight: 90}, {Name: "canary", URL: d.canaryURL, Weight: 10}}
		// The guard weighs both sides once a second from 100 requests each
		// on: a canary 20% worse on TTFT or E2E p95, with confidence, is
		// stopped.
		chat.Guard = &proxy.Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 100, MaxTTFTP95Increase: 0.2, MaxE2EP95Increase: 0.2}
	}
	d.col = &counter{}
	sinks := []metrics.Sink{d.col}
	if d.logPath != "" {
		alog, err := metrics.OpenAccessLog(d.logPath, 0)
		if err != nil {
			return err
		}
		d.closers = append(d.closers, func() { alog.Close() })
		sinks = append(sinks, alog)
	}
	t := proxy.DefaultTimeouts
	p, err := proxy.New(proxy.Config{
		Routes: []proxy.Route{
			// Chat users expect the first word fast.
			chat,
			// Two backends, one prefilling four times slower: each request
			// goes where its first token is predicted soonest.
			{Name: "completions", Prefix: "/v1/completions", Timeouts: t, Balance: proxy.BalanceLeastTTFT,
				Upstreams: []proxy.Upstream{{Name: "fast", URL: d.upstream, Weight: 1}, {Name: "slow", URL: d.slowURL, Weight: 1}}},
			{Name: "anthropic", Prefix: "/v1/messages", Upstream: d.upstream, Timeouts: t},
			{Name: "ollama", Prefix: "/api/", Upstream: d.upstream, Timeouts: t},
		},
		Models: []string{"demo-small", "demo-large"},
		SLO:    metrics.SLO{TTFT: 300 * time.Millisecond, TPOT: 25 * time.Millisecond, E2E: 5 * time.Second, Target: 0.95},
		// Dollars per million tokens: each record's cost_usd.
		Prices: []proxy.Price{{Model: "demo-small", Input: 0.15, CachedInput: -1, CacheWrite: -1, Output: 0.60},
			{Model: "demo-large", Input: 2.50, CachedInput: 1.25, CacheWrite: -1, Output: 10}},
	}, proxy.Options{Sinks: sinks})
	if err != nil {
		return err
	}
	d.p = p
	d.closers = append(d.closers, p.Close)
	ln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		return err
	}
	go func() { _ = p.Serve(ln) }()
	d.closers = append(d.closers, func() { _ = p.Shutdown(context.Background()) })
	d.base = "http://" + ln.Addr().String()
	d.client = &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: d.conc}}
	return nil
}

// demoMix is the traffic: short chats, long prompts with short answers,
// long outputs, a reasoning model, non-streamed chats, streamed
// completions, and the Anthropic and Ollama dialects.
var demoMix = func() []struct{ path, body string } {
	long := strings.Repeat("lorem ipsum dolor sit amet ", 400)
	return []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"demo-small","stream":true,"max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":8,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"` + long + `"}]}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":64,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"write"}]}`},
		{"/v1/chat/completions", `{"model":"demo-small","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/completions", `{"model":"demo-small","stream":true,"max_tokens":24,"prompt":"once upon a time"}`},
		{"/v1/chat/completions", `{"model":"demo-large","stream":true,"max_tokens":16,"mock_reasoning_tokens":24,"messages":[{"role":"user","content":"why?"}]}`},
		{"/v1/messages", `{"model":"demo-large","stream":true,"max_tokens":24,"mock_reasoning_tokens":8,"messages":[{"role":"user","content":"hi"}]}`},
		{"/api/chat", `{"model":"demo-small","options":{"num_predict":24},"messages":[{"role":"user","content":"hi"}]}`},
	}
}()

// send sends the mix's request i and reads its response whole.
func (d *demo) send(i int64) bool {
	m := demoMix[i%int64(len(demoMix))]
	resp, err := d.client.Post(d.base+m.path, "application/json", strings.NewReader(m.body))
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return true
}

// burst sends the n requests, conc at a time, and waits for their records.
func (d *demo) burst() {
	fmt.Fprintf(d.out, "simulated backend on %s, tokentap on %s\n"+
		"SLOs: TTFT 300 ms (chat: 150 ms), TPOT 25 ms, E2E 5 s; goodput target 95%%\n"+
		"sending %d requests, %d at a time...\n\n", d.upstream, d.base, d.n, d.conc)
	var wg sync.WaitGroup
	start := time.Now()
	for range d.conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := d.next.Add(1) - 1
				if i >= int64(d.n) {
					return
				}
				if !d.send(i) {
					d.failed.Add(1)
				}
			}
		}()
	}
	// A line a second while it runs: nothing is silent for long.
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fmt.Fprintf(d.out, "  %d of %d sent\n", min(d.next.Load(), int64(d.n)), d.n)
			}
		}
	}()
	wg.Wait()
	close(done)
	<-stopped // its last line written before the report's
	d.wall = time.Since(start)
	d.col.wait(d.n - int(d.failed.Load()))
}

// report prints what tokentap measured, and the canary's verdict.
func (d *demo) report() {
	out := d.out
	groupBy := []string{"route"}
	if d.canary {
		groupBy = append(groupBy, "upstream")
	}
	rep := d.p.Stats().Query(stats.Query{Window: "all", GroupBy: groupBy})
	rep.Overload = d.p.Overload()
	printStats(out, rep)
	if d.canary {
		fmt.Fprintln(out)
		c, err := d.p.Stats().Compare("chat", "stable", "canary", "all")
		if err != nil {
			fmt.Fprintln(out, "no verdict:", err)
		} else {
			printComparison(out, c, false)
		}
		fmt.Fprintln(out, "guard: stops the canary when its TTFT or E2E p95 is 20% above stable's with confidence; it weighs once a second from 100 requests a side on (keep it running with -serve, and watch /stats)")
	}
	fmt.Fprintf(out, "\n%d requests in %v (%d client errors). Times in ms at tokentap's client side; TTFT is the first\n"+
		"token of any kind, TTFA the first answer token (reasoning models wait between the two); ITL is every\n"+
		"gap between tokens. Goodput: the share of requests that met every SLO of their route.\n",
		d.n, d.wall.Round(time.Millisecond), d.failed.Load())
}

// serve serves the dashboard, /stats and /metrics with traffic going on,
// until ctx ends.
func (d *demo) serve(ctx context.Context) {
	a := &admin{logger: zap.NewNop(), p: d.p, running: &settings{}}
	a.ready.Store(true)
	srv := a.server()
	go func() { _ = srv.Serve(newAdminListener(d.adminLn)) }()
	defer func() { _ = srv.Shutdown() }()
	addr := d.adminLn.Addr()
	fmt.Fprintf(d.out, "\ndashboard: http://%s/   stats: http://%s/stats   metrics: http://%s/metrics\n"+
		"traffic keeps flowing (up to %d at a time, rising and falling); Ctrl-C stops.\n", addr, addr, addr, d.liveConc)
	var live sync.WaitGroup
	for w := range d.liveConc {
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
				d.send(d.next.Add(1))
			}
		}()
	}
	<-ctx.Done()
	d.client.CloseIdleConnections()
	live.Wait()
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
	ups := byUpstream(rep.Groups)
	fmt.Fprintln(tw, "route\tmodel\ttenant\t"+ups.head+"count\terrors\tlimited\trefused\tgoodput\tTTFT p50\tp95\tp99\tTTFA p50\tp99\tITL p50\tp95\tp99\tE2E p50\tp95\tp99\tqueue p95\toverhead p95\ttokens/s\t")
	judged := false
	for _, g := range rep.Groups {
		judged = judged || g.Goodput.Judged > 0
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
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t\n",
			dash(g.Route), dash(g.Model), dash(g.Tenant), ups.cell(g), g.Count, g.Errors, g.Limited, g.Refused, good,
			f(g.TTFT, g.TTFT.P50), f(g.TTFT, g.TTFT.P95), f(g.TTFT, g.TTFT.P99), f(g.TTFA, g.TTFA.P50), f(g.TTFA, g.TTFA.P99),
			f(g.ITL, g.ITL.P50), f(g.ITL, g.ITL.P95), f(g.ITL, g.ITL.P99), f(g.E2E, g.E2E.P50), f(g.E2E, g.E2E.P95), f(g.E2E, g.E2E.P99),
			f(g.Queue, g.Queue.P95), f(g.Overhead, g.Overhead.P95), g.OutputTokensPerS)
	}
	_ = tw.Flush()
	if !judged && len(rep.Groups) > 0 {
		fmt.Fprintln(out, "goodput: no SLO set, nothing judged; -slo ttft=500ms,tpot=50ms or slo: {ttft: 500ms} in the config turns it on")
	}
	printCost(out, rep.Groups)
	printReading(out, rep.Groups)
	printOverload(out, rep.Overload)
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

// printCost prints what each group's requests cost (prices) and how
// often its backend's prompt cache served them, where known.
func printCost(out io.Writer, groups []stats.Group) {
	var rows []stats.Group
	for _, g := range groups {
		if g.Priced > 0 || g.CacheReported > 0 {
			rows = append(rows, g)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(out, "\ncost and prompt cache:")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	ups := byUpstream(rows)
	fmt.Fprintln(tw, "route\tmodel\ttenant\t"+ups.head+"priced\tcost $\t$ per good\tcache hits\t")
	for _, g := range rows {
		per, hits := "-", "-"
		if g.CostPerGoodUSD != nil {
			per = fmt.Sprintf("%.6f", *g.CostPerGoodUSD)
		}
		if g.CacheHitShare != nil {
			hits = fmt.Sprintf("%.1f%% of %d", 100**g.CacheHitShare, g.CacheReported)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s%d\t%.6f\t%s\t%s\t\n", dash(g.Route), dash(g.Model), dash(g.Tenant), ups.cell(g), g.Priced, g.CostUSD, per, hits)
	}
	_ = tw.Flush()
}

// printOverload prints what overload control sees of each upstream: its
// learned limit, the prediction now against how well it predicted, and
// what it shed.
func printOverload(out io.Writer, os []stats.Overload) {
	if len(os) == 0 {
		return
	}
	fmt.Fprintln(out, "\noverload control:")
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "route\tupstream\tmode\tin flight\tlimit\tpredicted TTFT\tTPOT\tprediction error\tbias\tarrivals/s\tcompleted/s\tshed\tshed/s\t")
	for _, o := range os {
		mode := "predicting"
		if o.Enforcing {
			mode = "shedding on"
			if o.Shedding {
				mode = "SHEDDING"
			}
		}
		limit, ttft, tpot, errs := "-", "-", "-", "-"
		if o.Known {
			limit, ttft = fmt.Sprint(o.Limit), fmt.Sprintf("%.0f ms", o.PredictedTTFTMs)
			if o.PredictedTPOTMs >= 0 {
				tpot = fmt.Sprintf("%.1f ms", o.PredictedTPOTMs)
			}
		}
		if o.Judged > 0 {
			errs = fmt.Sprintf("%.0f%%\t%+.0f%%", 100*o.AbsError, 100*o.Bias)
		} else {
			errs = "-\t-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%.1f\t%.1f\t%d\t%.1f\t\n",
			o.Route, dash(o.Upstream), mode, o.InFlight, limit, ttft, tpot, errs, o.ArrivalsPerS, o.CompletionsPerS, o.Shed, o.ShedPerS)
	}
	_ = tw.Flush()
}

// upstreamColumn is a table's upstream column: there where rows differ
// by upstream (two rows of one route, model and tenant would read alike
// without it), absent where none does.
type upstreamColumn struct{ head string }

func byUpstream(groups []stats.Group) upstreamColumn {
	for _, g := range groups {
		if g.Upstream != "" {
			return upstreamColumn{head: "upstream\t"}
		}
	}
	return upstreamColumn{}
}

func (c upstreamColumn) cell(g stats.Group) string {
	if c.head == "" {
		return ""
	}
	return dash(g.Upstream) + "\t"
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
