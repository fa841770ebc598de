package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/tokentap/tokentap/examples/mockllm"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy"
)

// runDemo starts the simulated backend and tokentap in front of it on
// loopback, sends a short burst of mixed traffic through tokentap, and
// prints what tokentap measured per route.
func runDemo(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap demo", flag.ContinueOnError)
	n := fs.Int("requests", 120, "requests to send")
	conc := fs.Int("concurrency", 12, "requests in flight at once")
	logPath := fs.String("access-log", "", "also write the access log here (- for stdout)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n <= 0 || *conc <= 0 {
		return fmt.Errorf("-requests and -concurrency must be positive")
	}

	backendLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	backend := &http.Server{Handler: mockllm.New(mockllm.Options{
		PrefillBase: 30 * time.Millisecond, PrefillPerToken: 50 * time.Microsecond, TokenGap: 8 * time.Millisecond,
	})}
	go func() { _ = backend.Serve(backendLn) }()
	defer backend.Close()
	upstream := "http://" + backendLn.Addr().String()

	col := &collector{byRoute: map[string][]metrics.Record{}}
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
			{Name: "chat", Prefix: "/v1/chat/", Upstream: upstream, Timeouts: t, InjectUsage: true},
			{Name: "completions", Prefix: "/v1/completions", Upstream: upstream, Timeouts: t},
			{Name: "anthropic", Prefix: "/v1/messages", Upstream: upstream, Timeouts: t},
			{Name: "ollama", Prefix: "/api/", Upstream: upstream, Timeouts: t},
		},
		Models: []string{"demo-small", "demo-large"},
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
	fmt.Fprintf(out, "simulated backend on %s, tokentap on %s\nsending %d requests, %d at a time...\n\n", upstream, base, *n, *conc)

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
				m := mix[i%int64(len(mix))]
				resp, err := client.Post(base+m.path, "application/json", strings.NewReader(m.body))
				if err != nil {
					failed.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	wall := time.Since(start)
	col.wait(*n - int(failed.Load()))
	col.print(out, wall)
	fmt.Fprintf(out, "\n%d requests in %v (%d client errors). TTFT, TTFA, ITL and E2E are what tokentap measured on its\n"+
		"client side. TTFT is the first token of any kind, TTFA the first answer token: reasoning models wait\n"+
		"between the two. ITL percentiles are over each request's mean gap, weighted by its number of gaps.\n"+
		"Per-request records: add -access-log -. Histograms: /metrics on the admin listener when run as a proxy.\n",
		*n, wall.Round(time.Millisecond), failed.Load())
	return nil
}

// collector keeps the demo's records by route.
type collector struct {
	mu      sync.Mutex
	count   int
	byRoute map[string][]metrics.Record
}

func (c *collector) Observe(r *metrics.Record) {
	c.mu.Lock()
	c.byRoute[r.Route] = append(c.byRoute[r.Route], *r)
	c.count++
	c.mu.Unlock()
}

func (c *collector) wait(n int) {
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		c.mu.Lock()
		done := c.count >= n
		c.mu.Unlock()
		if done {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (c *collector) print(out io.Writer, wall time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "route\tcount\tok\tTTFT p50\tp95\tp99\tTTFA p50\tp99\tITL p50\tp95\tp99\tE2E p50\tp95\tp99\ttokens/s\t")
	routes := make([]string, 0, len(c.byRoute))
	for r := range c.byRoute {
		routes = append(routes, r)
	}
	slices.Sort(routes)
	for _, route := range routes {
		recs := c.byRoute[route]
		var ttft, ttfa, itl, e2e []time.Duration
		ok, tokens := 0, 0
		for _, r := range recs {
			if r.Outcome == metrics.OutcomeOK {
				ok++
			}
			if r.TTFT >= 0 {
				ttft = append(ttft, r.TTFT)
			}
			if r.TTFA >= 0 {
				ttfa = append(ttfa, r.TTFA)
			}
			if r.ITLCount > 0 {
				// Per-request mean gap, weighted by its gap count.
				for range r.ITLCount {
					itl = append(itl, r.ITLMean)
				}
			}
			e2e = append(e2e, r.E2E)
			tokens += r.OutputTokens
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t\n", route, len(recs), ok,
			pct(ttft, 50), pct(ttft, 95), pct(ttft, 99), pct(ttfa, 50), pct(ttfa, 99), pct(itl, 50), pct(itl, 95), pct(itl, 99),
			pct(e2e, 50), pct(e2e, 95), pct(e2e, 99), float64(tokens)/wall.Seconds())
	}
	_ = tw.Flush()
}

// pct is the nearest-rank percentile, formatted in milliseconds.
func pct(d []time.Duration, p int) string {
	if len(d) == 0 {
		return "-"
	}
	slices.Sort(d)
	i := (len(d)*p + 99) / 100
	return fmt.Sprintf("%.1fms", float64(d[max(i-1, 0)].Microseconds())/1000)
}
