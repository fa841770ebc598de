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
)

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
			if s := tp.p.snap.Load().routes[0].set.Members()[0].Scrape.State(); s == nil || !strings.Contains(s.Err, "implausible") {
				return fmt.Errorf("a scrape of %s reads %+v", huge, s)
			}
			return nil
		})
		if n := tp.p.snap.Load().routes[0].set.Members()[0].Scrape.Others(time.Now(), 3); n != 0 {
			t.Errorf("a scrape of %s adds %d requests", huge, n)
		}
	}
}
