package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"github.com/tokentap/tokentap/proxy/upstream"
)

func TestParseBackendMetrics(t *testing.T) {
	cases := []struct {
		name, text           string
		running, waiting, kv float64
	}{
		{"vllm", `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.61
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
`, 8, 7, 0.61},
		{"llama.cpp", "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n", 2, 1, -1},
		{"sglang", "sglang:num_running_reqs{model_name=\"q\"} 4\nsglang:num_queue_reqs{model_name=\"q\"} 0\nsglang:token_usage{model_name=\"q\"} 0.2\n", 4, 0, 0.2},
		{"garbage", "vllm:num_requests_running{ 3\nvllm:num_requests_waiting NaN\nvllm:num_requests_waiting -4\n\x00\xff\nother 1\n", -1, -1, -1},
		{"label with braces", `vllm:num_requests_running{model_name="a}b"} 2 1700000000000` + "\n", 2, -1, -1},
	}
	for _, c := range cases {
		st := &backendState{Running: -1, Waiting: -1, KV: -1}
		parseBackendMetrics([]byte(c.text), st)
		if st.Running != c.running || st.Waiting != c.waiting || st.KV != c.kv {
			t.Errorf("%s: running %v waiting %v kv %v, want %v %v %v", c.name, st.Running, st.Waiting, st.KV, c.running, c.waiting, c.kv)
		}
	}
}

func FuzzParseBackendMetrics(f *testing.F) {
	f.Add([]byte("vllm:num_requests_running{a=\"b\"} 3\n"))
	f.Add([]byte("# x\nllamacpp:requests_deferred 1e3 12\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st := &backendState{Running: -1, Waiting: -1, KV: -1}
		parseBackendMetrics(b, st)
		if st.KV > 1 || st.Running < -1 || st.Waiting < -1 {
			t.Fatalf("out of range: %+v", st)
		}
	})
}

// TestLeastTTFTWeighsBackendQueue: two like simulated servers behind a
// least_ttft route; after both are learned, another client fills one of
// them directly (its 2 slots and 4 waiting). With metrics_url the
// overload table shows what that server's own metrics say (2 running, 3
// or 4 waiting); a metrics_url that fails says why, and routing goes on by
// what tokentap measures. How many requests each sends the loaded server
// is logged (a handful of 26 fewer with the scrape); the decision itself
// is checked on known figures by TestPredictionWeighsBackendQueue.
func TestLeastTTFTWeighsBackendQueue(t *testing.T) {
	wait.Long(t, "another client's load on a backend")
	opts := mockllm.Options{Slots: 2, PrefillBase: 30 * time.Millisecond, TokenGap: 5 * time.Millisecond, MaxTokens: 10, Jitter: 0.1}
	run := func(scrape bool) {
		a, b := httptest.NewServer(mockllm.New(opts)), httptest.NewServer(mockllm.New(opts))
		t.Cleanup(a.Close)
		t.Cleanup(b.Close)
		t.Cleanup(a.CloseClientConnections)
		t.Cleanup(b.CloseClientConnections)
		metricsURL := a.URL + "/nowhere"
		if scrape {
			metricsURL = a.URL + "/metrics"
		}
		tp := startProxyRecords(t, "", func(c *Config) {
			c.Routes = []Route{{Name: "split", Prefix: "/", Timeouts: DefaultTimeouts, Balance: BalanceLeastTTFT,
				Upstreams: []Upstream{{Name: "a", URL: a.URL, Weight: 1, MetricsURL: metricsURL}, {Name: "b", URL: b.URL, Weight: 1}}}}
		}, Options{}, 10000)
		rng := rand.New(rand.NewPCG(9, 9))
		w := offer(t, tp, chatBody, 12, 4*time.Second, 0, rng)
		for range w.arrivals {
			tp.rec.next(t)
		}
		// Another client fills a: 6 requests at a time, sent directly.
		ctx, stop := context.WithCancel(context.Background())
		defer stop()
		var bg sync.WaitGroup
		defer bg.Wait()
		for range 6 {
			bg.Go(func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, "POST", a.URL+"/v1/chat/completions", strings.NewReader(chatBody))
					if resp, err := http.DefaultClient.Do(req); err == nil {
						io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
					}
				}
			})
		}
		// A scrape or two: once one came after the load began, the table
		// shows it (the scrapes' period is the machine's, not the test's).
		waitFor(t, func() error {
			if complaint := scrapeShown(tp, "a", scrape); complaint != "" {
				return errors.New(complaint)
			}
			return nil
		})
		tl := offer(t, tp, chatBody, 12, 2*time.Second, 0, rng)
		toA := 0
		for range tl.arrivals {
			if r := tp.rec.next(t); r.Upstream == "a" {
				toA++
			} else if r.Status != 200 {
				t.Errorf("a request failed: %d", r.Status)
			}
		}
		t.Logf("scrape %v: %d of %d to the loaded server", scrape, toA, tl.arrivals)
		stop()
	}
	var wg sync.WaitGroup
	wg.Go(func() { run(true) })
	wg.Go(func() { run(false) })
	wg.Wait()
}

// TestPredictionWeighsBackendQueue: two upstreams whose models learned the
// same 30 ms first token at every level tokentap saw; the first's server
// reports 2 running and 4 waiting (another client's), its requests held
// it 80 ms each. Its prediction is at least its turn in that queue, 30 +
// (4+1) x 80 / 2 = 230 ms, and least_ttft sends the request elsewhere but
// for a probe; without a fresh scrape the two are alike and the first (a
// tie to the first) is chosen.
func TestPredictionWeighsBackendQueue(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	var members []*member
	for _, name := range []string{"a", "b"} {
		up, err := upstream.New("http://127.0.0.1:1", DefaultTimeouts, clock, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 40 {
			up.Gate.Model.Observe(i%3, 100, 30*time.Millisecond, 5*time.Millisecond, -1)
		}
		members = append(members, &member{name: name, up: up, weight: 1})
	}
	a := members[0]
	a.scrape = newScraper("http://127.0.0.1:1/metrics", clock)
	a.noteSlot(80 * time.Millisecond)
	r := &route{Route: Route{Balance: BalanceLeastTTFT}, members: members}

	a.scrape.state.Store(&backendState{Running: 2, Waiting: 4, KV: -1, At: now})
	ta, _ := a.predictTTFT(now, 0, 100)
	if ta < 229*time.Millisecond || ta > 231*time.Millisecond {
		t.Errorf("prediction with a queue of 4 ahead: %v, want 230ms", ta)
	}
	if m, _, why := r.leastTTFT(now, 100, 0.5, 0); m != members[1] || why != pickLeastTTFT {
		t.Errorf("with a's queue: chose %s (%s), want b", m.name, pickReasonNames[why])
	}
	if m, _, why := r.leastTTFT(now, 100, 0.001, 0); m != a || why != pickProbe {
		t.Errorf("a probe's roll: chose %s (%s), want a as a probe", m.name, pickReasonNames[why])
	}
	// The scrape grows stale: nothing said, the two alike.
	now = now.Add(scrapeFresh + time.Second)
	if tb, _ := a.predictTTFT(now, 0, 100); tb > 40*time.Millisecond {
		t.Errorf("a stale scrape still weighs: %v", tb)
	}
	if m, _, _ := r.leastTTFT(now, 100, 0.5, 0); m != a {
		t.Errorf("without a fresh scrape: chose %s, want the tie's first, a", m.name)
	}
}

// scrapeShown says what is wrong with the backend state the overload table
// shows for upstream (scrape: its metrics were scraped, else the scrape
// fails with 400), or "" when it is as it should be.
func scrapeShown(tp *testProxy, upstream string, scrape bool) string {
	var shown *stats.BackendState
	for _, o := range tp.p.Overload() {
		if o.Upstream == upstream {
			shown = o.Backend
		}
	}
	switch {
	case shown == nil:
		return fmt.Sprintf("scrape %v: the overload table shows no backend state for %s", scrape, upstream)
	case scrape && (shown.Error != "" || shown.Running != 2 || shown.Waiting < 3 || shown.Waiting > 4 || shown.AgeS > 1.5):
		return fmt.Sprintf("the loaded server's metrics shown as %+v, want 2 running and 3 or 4 waiting, fresh", shown)
	case !scrape && !strings.Contains(shown.Error, "scrape answered 400"):
		return fmt.Sprintf("a failing scrape shows %+v, want its status", shown)
	}
	return ""
}

// TestAScrapeCannotSwitchSheddingOff: tokentap sheds in front of the
// simulated server of 8 slots (about 28 a second) offered twice its
// capacity, its metrics_url a script. At half the capacity, for 4 s the
// script claims 1,000 requests running; then the truth (nothing beyond
// tokentap's), and twice the capacity. In the 6 s after the claim,
// shedding keeps at least 0.6 of the capacity good: the
// level a scrape adds is bounded by tokentap's own in flight, so the
// figures the model files during the claim stay near the levels it
// measures. Before, the claim moved the learned limit from 66 to 1,024 and
// nothing was shed for 7.5 s after it (16 of 663 good). A claim past what
// any backend holds (1e300, 9.3e18) is refused as implausible, never read
// as an idle backend.
func TestAScrapeCannotSwitchSheddingOff(t *testing.T) {
	wait.Long(t, "13 s of load around a false scrape")
	const capacity = 28.0
	var claim atomic.Value
	claim.Store("vllm:num_requests_running 0\n")
	metricsSrv := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, claim.Load().(string)) })
	srv := httptest.NewServer(mockllm.New(overloadBackend))
	t.Cleanup(srv.CloseClientConnections)
	t.Cleanup(srv.Close)
	tp := startProxyRecords(t, "", func(c *Config) {
		c.SLO = overloadSLO
		c.Routes[0].Upstreams = []Upstream{{Name: "a", URL: srv.URL, MetricsURL: metricsSrv.URL, Weight: 1}}
		c.Routes[0].Overload = &Overload{Shed: true}
	}, Options{}, 20000)
	rng := rand.New(rand.NewPCG(31, 7))
	phase := func(load float64, d time.Duration) *tally { return offer(t, tp, chatBody, load*capacity, d, 0, rng) }
	for _, c := range []struct {
		claim string
		load  float64
		d     time.Duration
	}{{"vllm:num_requests_running 0\n", 0.5, 3 * time.Second}, {"vllm:num_requests_running 1000\nvllm:num_requests_waiting 0\n", 0.5, 4 * time.Second}} {
		claim.Store(c.claim)
		w := phase(c.load, c.d)
		for range w.arrivals {
			tp.rec.next(t)
		}
	}
	claim.Store("vllm:num_requests_running 0\n")
	after := phase(2, 6*time.Second)
	countRecords(t, tp, after, after.arrivals)
	t.Logf("the 6 s after the claim: %d sent, %d good (%.1f/s), %d shed", after.sent, after.good, float64(after.good)/6, after.shed)
	if float64(after.good)/6 < 0.6*capacity {
		t.Errorf("after a scrape claimed 1,000 running: %.1f good/s, want 0.6 of the capacity %.0f", float64(after.good)/6, capacity)
	}
	for _, huge := range []string{"1e300", "9.3e18"} {
		claim.Store("vllm:num_requests_running " + huge + "\n")
		waitFor(t, func() error {
			if s := tp.p.snap.Load().routes[0].members[0].scrape.state.Load(); s == nil || !strings.Contains(s.Err, "implausible") {
				return fmt.Errorf("a scrape of %s reads %+v", huge, s)
			}
			return nil
		})
		if n := tp.p.snap.Load().routes[0].members[0].scrape.others(time.Now(), 3); n != 0 {
			t.Errorf("a scrape of %s adds %d requests", huge, n)
		}
	}
}
