package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

// The overload demo's simulated server: 8 slots, the others waiting in
// order; 40 ms of prefill and 20 tokens whose gap grows with the batch
// (10 ms alone, 12.1 at 8): a request holds its slot about 280 ms, so it
// serves about 28 requests a second.
var (
	overloadBackend = mockllm.Options{Slots: 8, PrefillBase: 40 * time.Millisecond, PrefillPerToken: time.Microsecond,
		TokenGap: 10 * time.Millisecond, Jitter: 0.1, BatchSlowdown: 0.03, MaxTokens: 20}
	overloadCapacity = 28.0
	overloadSLO      = metrics.SLO{TTFT: 300 * time.Millisecond, TPOT: 30 * time.Millisecond}
)

// overloadRun is what one side of the overload demo got, over its
// measured part: tokentap's records of the requests that arrived in it.
type overloadRun struct {
	sent, good, shed int
	ttft             []time.Duration // of the requests served
	gate             []stats.Overload
}

// runOverloadDemo is `tokentap demo -overload`: twice the simulated
// server's capacity, offered for warm then d, through a tokentap that
// forwards everything and then through one that sheds, goodput side by
// side.
func runOverloadDemo(ctx context.Context, out io.Writer, warm, d time.Duration) error {
	rate := 2 * overloadCapacity
	fmt.Fprintf(out, "tokentap demo -overload: a simulated server of %d slots (about %.0f requests/s), SLO TTFT %v and TPOT %v;\n"+
		"offering %.0f requests/s (twice its capacity, Poisson arrivals) for %v, the last %v measured: first forwarding everything, then shedding...\n",
		overloadBackend.Slots, overloadCapacity, overloadSLO.TTFT, overloadSLO.TPOT, rate, warm+d, d)
	var runs [2]overloadRun
	for i, shed := range []bool{false, true} {
		r, err := overloadSide(ctx, shed, rate, warm, d)
		if err != nil {
			return err
		}
		runs[i] = r
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\tforward everything\tshed by prediction\t")
	row := func(name string, f func(r *overloadRun) string) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t\n", name, f(&runs[0]), f(&runs[1]))
	}
	row("requests", func(r *overloadRun) string { return fmt.Sprint(r.sent) })
	row("good (met both objectives)", func(r *overloadRun) string { return fmt.Sprint(r.good) })
	row("goodput", func(r *overloadRun) string { return fmt.Sprintf("%.1f/s", float64(r.good)/d.Seconds()) })
	row("shed (503, Retry-After)", func(r *overloadRun) string { return fmt.Sprint(r.shed) })
	pct := func(r *overloadRun, p float64) string {
		if len(r.ttft) == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f ms", float64(r.ttft[min(len(r.ttft)-1, int(p*float64(len(r.ttft))))])/1e6)
	}
	row("TTFT p50 of those served", func(r *overloadRun) string { return pct(r, 0.5) })
	row("TTFT p99 of those served", func(r *overloadRun) string { return pct(r, 0.99) })
	_ = tw.Flush()
	printOverload(out, runs[1].gate)
	fmt.Fprintln(out, "\nForwarding everything, the server's queue grows without end: it stays fully busy and nearly every user misses the TTFT objective.\n"+
		"Shedding refuses, at once, the requests the model predicts would miss; a shed request counts against goodput.")
	return nil
}

// overloadSide runs one side: a fresh simulated server and a tokentap in
// front of it, shedding or not, offered rate a second for warm + d.
func overloadSide(ctx context.Context, shed bool, rate float64, warm, d time.Duration) (overloadRun, error) {
	var r overloadRun
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return r, err
	}
	srv := &http.Server{Handler: mockllm.New(overloadBackend)}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	col := &recordsAfter{from: time.Now().Add(warm)}
	p, err := proxy.New(proxy.Config{
		Routes: []proxy.Route{{Name: "chat", Prefix: "/", Upstream: "http://" + ln.Addr().String(), Timeouts: proxy.DefaultTimeouts,
			Overload: &proxy.Overload{Shed: shed}}},
		SLO: overloadSLO,
	}, proxy.Options{Sinks: []metrics.Sink{col}})
	if err != nil {
		return r, err
	}
	defer p.Close()
	pln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		return r, err
	}
	go func() { _ = p.Serve(pln) }()
	defer func() { _ = p.Shutdown(context.Background()) }()
	url := "http://" + pln.Addr().String() + "/v1/chat/completions"
	client := &http.Client{Timeout: time.Minute, Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	defer client.CloseIdleConnections()
	start := time.Now()
	counted := 0
	rng := rand.New(rand.NewPCG(uint64(start.UnixNano()), 1))
	var wg sync.WaitGroup
	for next := time.Duration(0); next < warm+d && ctx.Err() == nil; next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second)) {
		time.Sleep(time.Until(start.Add(next)))
		if time.Now().After(col.from) {
			counted++
		}
		wg.Go(func() {
			resp, err := client.Post(url, "application/json", strings.NewReader(`{"model":"demo","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	r.gate = p.Overload()
	// A record comes a moment after its response's last byte.
	for deadline := time.Now().Add(5 * time.Second); col.count() < counted && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	col.mu.Lock()
	defer col.mu.Unlock()
	for _, rec := range col.recs {
		r.sent++
		switch {
		case rec.Outcome == metrics.OutcomeShed:
			r.shed++
		case rec.Good():
			r.good++
		}
		if rec.Outcome != metrics.OutcomeShed && rec.TTFT >= 0 {
			r.ttft = append(r.ttft, rec.TTFT)
		}
	}
	slices.Sort(r.ttft)
	return r, nil
}

// recordsAfter keeps the records of the requests that arrived from from on.
type recordsAfter struct {
	from time.Time
	mu   sync.Mutex
	recs []metrics.Record
}

func (c *recordsAfter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.recs)
}

func (c *recordsAfter) Observe(r *metrics.Record) {
	if r.Start.Before(c.from) {
		return
	}
	c.mu.Lock()
	c.recs = append(c.recs, *r)
	c.mu.Unlock()
}
