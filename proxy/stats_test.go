package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/ratelimit"
)

// startMock runs the simulated backend on loopback.
func startMock(t *testing.T, o mockllm.Options) string {
	t.Helper()
	s := httptest.NewServer(mockllm.New(o))
	t.Cleanup(s.CloseClientConnections)
	t.Cleanup(s.Close)
	return s.URL
}

const streamChat = `{"model":"m","stream":true,"max_tokens":12,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`

// drive sends n streamed chats through tp, conc at a time, and waits for
// their records.
func drive(t *testing.T, tp *testProxy, n, conc int, key string) {
	t.Helper()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) {
				if key != "" {
					chat(t, tp.url, "Authorization", "Bearer "+key)
				} else {
					chat(t, tp.url)
				}
			}
		}()
	}
	wg.Wait()
	for range n {
		tp.rec.next(t)
	}
}

func kinds(ws []stats.Warning) map[string]stats.Warning {
	m := map[string]stats.Warning{}
	for _, w := range ws {
		m[w.Kind] = w
	}
	return m
}

var healthyMock = mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: 3 * time.Millisecond}

// TestHealthyTrafficRaisesNoWarning: SLOs met, no queue, a smooth stream:
// the table is right and nothing warns.
func TestHealthyTrafficRaisesNoWarning(t *testing.T) {
	tp := startProxy(t, startMock(t, healthyMock), func(c *Config) {
		c.Models = []string{"m"}
		c.SLO = metrics.SLO{TTFT: 5 * time.Second, E2E: 30 * time.Second, Target: 0.9}
		// The overhead threshold is the machine's to set: a loaded test
		// machine does add 10 ms (TestOverheadWarning covers it).
		c.Warn = stats.WarnOptions{MinRequests: 10, OverheadP95: time.Second}
	})
	drive(t, tp, 30, 3, "")
	rep := tp.p.Stats().Query(stats.Query{})
	if len(rep.Warnings) != 0 {
		t.Fatalf("warnings on healthy traffic: %+v", rep.Warnings)
	}
	if len(rep.Groups) != 1 {
		t.Fatalf("groups %+v", rep.Groups)
	}
	g := rep.Groups[0]
	if g.Route != "default" || g.Model != "m" || g.Tenant != "default" || g.Count != 30 || g.Errors != 0 {
		t.Errorf("group %+v", g)
	}
	if g.Goodput.Judged != 30 || g.Goodput.Good != 30 || g.OutputTokensPerS <= 0 {
		t.Errorf("goodput %+v, tokens/s %v", g.Goodput, g.OutputTokensPerS)
	}
	// 12 tokens, 11 gaps each; the mock's gap is 3 ms ± 20%, so ITL p50 is
	// at least 2.4 ms (the proxy can only delay a token, never hasten it
	// past its predecessor by more than the gap).
	if g.ITL.Count != 30*11 || g.ITL.P50 < 2 || g.TTFT.P50 < 10 || g.TTFT.Count != 30 {
		t.Errorf("ttft %+v itl %+v", g.TTFT, g.ITL)
	}
}

// TestBufferingWarning: a hop that holds the stream back (the backend
// flushes only at the end) makes every token arrive with the last.
func TestBufferingWarning(t *testing.T) {
	o := healthyMock
	o.FlushEvery = 1000
	tp := startProxy(t, startMock(t, o), func(c *Config) { c.Warn = stats.WarnOptions{MinRequests: 10} })
	drive(t, tp, 12, 3, "")
	w, ok := kinds(tp.p.Stats().Query(stats.Query{}).Warnings)[stats.WarnBuffering]
	if !ok {
		t.Fatalf("no buffering warning: %+v", tp.p.Stats().Query(stats.Query{}))
	}
	if w.Values["itl_p50_ms"] >= 1 || w.Values["ttft_p50_ms"] < 0.8*w.Values["e2e_p50_ms"] || !strings.Contains(w.Message, "buffering") {
		t.Errorf("warning %+v", w)
	}
}

// TestQueueDominatesWarning: one stream at a time for a tenant sending
// four at once: most of each wait is the admission queue.
func TestQueueDominatesWarning(t *testing.T) {
	tp := startProxy(t, startMock(t, healthyMock), func(c *Config) {
		c.Admission = &ratelimit.Config{Mode: ratelimit.ModeQueue, MaxQueue: 100, MaxWait: 30 * time.Second,
			Tenants: []ratelimit.Tenant{{Name: "team", Keys: []string{"key-team-0123456789"}, Limits: ratelimit.Limits{MaxConcurrent: 1}}}}
		c.Warn = stats.WarnOptions{MinRequests: 10}
	})
	drive(t, tp, 16, 4, "key-team-0123456789")
	rep := tp.p.Stats().Query(stats.Query{Tenant: "team"})
	w, ok := kinds(rep.Warnings)[stats.WarnQueue]
	if !ok {
		t.Fatalf("no queue warning: %+v", rep)
	}
	if w.Tenant != "team" || w.Values["share"] < 0.5 || w.Values["queue_p50_ms"] < 5 {
		t.Errorf("warning %+v", w)
	}
}

// TestOverheadWarning: the threshold is the user's; real overhead above
// it warns, and the default threshold does not for the same traffic.
func TestOverheadWarning(t *testing.T) {
	tp := startProxy(t, startMock(t, healthyMock), func(c *Config) {
		c.Warn = stats.WarnOptions{MinRequests: 10, OverheadP95: time.Microsecond}
	})
	drive(t, tp, 12, 2, "")
	w, ok := kinds(tp.p.Stats().Query(stats.Query{}).Warnings)[stats.WarnOverhead]
	if !ok || w.Values["threshold_ms"] != 0.001 || w.Values["overhead_p95_ms"] <= 0.001 {
		t.Fatalf("overhead warning %v %+v", ok, w)
	}
	cfg := tp.p.snap.Load().cfg
	cfg.Warn = stats.WarnOptions{MinRequests: 10}
	if err := tp.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	// At the default threshold (10 ms) a warning is raised only if this
	// machine really added that much (a busy one can): never below it.
	if w, ok := kinds(tp.p.Stats().Query(stats.Query{}).Warnings)[stats.WarnOverhead]; ok &&
		(w.Values["threshold_ms"] != 10 || w.Values["overhead_p95_ms"] <= 10) {
		t.Errorf("overhead warning at the default threshold (10 ms): %+v", w)
	}
	// Above what was measured, none.
	cfg.Warn = stats.WarnOptions{MinRequests: 10, OverheadP95: time.Duration(2*w.Values["overhead_p95_ms"]*1e6) + time.Millisecond}
	if err := tp.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	if w, ok := kinds(tp.p.Stats().Query(stats.Query{}).Warnings)[stats.WarnOverhead]; ok {
		t.Errorf("overhead warning above the measured p95: %+v", w)
	}
}

// TestGoodputWarning: a first-token objective the backend cannot meet.
func TestGoodputWarning(t *testing.T) {
	tp := startProxy(t, startMock(t, healthyMock), func(c *Config) {
		c.SLO = metrics.SLO{TTFT: 2 * time.Millisecond, Target: 0.99}
		c.Warn = stats.WarnOptions{MinRequests: 10}
	})
	drive(t, tp, 12, 2, "")
	rep := tp.p.Stats().Query(stats.Query{})
	w, ok := kinds(rep.Warnings)[stats.WarnGoodput]
	if !ok {
		t.Fatalf("no goodput warning: %+v", rep)
	}
	if w.Values["goodput_ratio"] != 0 || w.Values["target"] != 0.99 || !strings.Contains(w.Message, "most missed: ttft, 12") {
		t.Errorf("warning %+v", w)
	}
	if g := rep.Groups[0].Goodput; g.Missed["ttft"] != 12 || g.Good != 0 {
		t.Errorf("goodput %+v", g)
	}
}

// offsetClock is the real clock plus an offset the test moves: the
// windows see minutes pass between two phases of real traffic.
type offsetClock struct{ off atomic.Int64 }

func (c *offsetClock) now() time.Time       { return time.Now().Add(time.Duration(c.off.Load())) }
func (c *offsetClock) jump(d time.Duration) { c.off.Add(int64(d)) }

// TestBatchingWarning: a backend that batches (each stream slows the
// others) given more streams at once: tokens/s up, TTFT p95 up. The same
// traffic twice raises nothing.
func TestBatchingWarning(t *testing.T) {
	for _, busier := range []bool{true, false} {
		o := healthyMock
		o.BatchSlowdown = 1
		clk := &offsetClock{}
		// Start just after a minute boundary of the windows' clock, so
		// that the first phase falls in one minute, three before the next.
		now := time.Now()
		clk.jump(now.Truncate(time.Minute).Add(time.Minute + time.Second).Sub(now))
		tp := startProxyOpts(t, startMock(t, o), func(c *Config) { c.Warn = stats.WarnOptions{MinRequests: 10} }, Options{StatsNow: clk.now})
		drive(t, tp, 20, 1, "")
		clk.jump(2 * time.Minute)
		if busier {
			drive(t, tp, 60, 8, "")
		} else {
			drive(t, tp, 20, 1, "")
		}
		rep := tp.p.Stats().Query(stats.Query{})
		w, ok := kinds(rep.Warnings)[stats.WarnBatching]
		if ok != busier {
			t.Fatalf("busier %v: batching warning %v: %+v", busier, ok, rep.Warnings)
		}
		if busier && (w.Values["output_tokens_per_s_recent"] < 1.1*w.Values["output_tokens_per_s_before"] ||
			w.Values["ttft_p95_ms_recent"] < 1.2*w.Values["ttft_p95_ms_before"] || w.Route != "default") {
			t.Errorf("warning %+v", w)
		}
	}
}

// TestRefusalsAreNotLatencies: a tenant allowed one request a second sends
// three at once: one served, two refused (429). /stats counts the three
// and the two refused apart, and times the one served alone: its E2E
// distribution holds one request, where the refusals' answers (a fraction
// of a millisecond) once read as the route's E2E; tokentap_e2e_seconds
// grows by one, tokentap_requests_total by three.
func TestRefusalsAreNotLatencies(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Routes[0].Name = "refusals"
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "slowpoke", Keys: []string{"ks"}, Limits: ratelimit.Limits{RequestsPerSecond: 0.01, Burst: 1}})(c)
	})
	e2e := func() float64 { return promFloat(t, `tokentap_e2e_seconds_count{route="refusals",model="m"}`) }
	reqs := func() float64 {
		return promFloat(t, `tokentap_requests_total{route="refusals",model="m",outcome="ok",status_class="2xx"}`) +
			promFloat(t, `tokentap_requests_total{route="refusals",model="m",outcome="limited",status_class="4xx"}`)
	}
	e2e0, reqs0 := e2e(), reqs()
	var statuses []int
	for range 3 {
		resp, _ := postKey(t, tp.url+"/v1/chat/completions", "ks", `{"model":"m","messages":[]}`)
		statuses = append(statuses, resp.StatusCode)
		tp.rec.next(t)
	}
	if !slicesEqual(statuses, []int{200, 429, 429}) {
		t.Fatalf("statuses %v", statuses)
	}
	rep := tp.p.Stats().Query(stats.Query{Window: "all", Route: "refusals"})
	if len(rep.Groups) != 1 {
		t.Fatalf("%d groups", len(rep.Groups))
	}
	g := rep.Groups[0]
	if g.Count != 3 || g.Refused != 2 || g.Limited != 2 || g.E2E.Count != 1 {
		t.Errorf("count %d, refused %d, limited %d; E2E of %d requests: want 3, 2, 2 and one", g.Count, g.Refused, g.Limited, g.E2E.Count)
	}
	if d := e2e() - e2e0; d != 1 {
		t.Errorf("tokentap_e2e_seconds_count grew by %v, want 1", d)
	}
	if d := reqs() - reqs0; d != 3 {
		t.Errorf("tokentap_requests_total grew by %v, want 3", d)
	}
}
