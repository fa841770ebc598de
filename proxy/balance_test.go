package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"github.com/tokentap/tokentap/ratelimit"
)

// twoBackends runs a fast and a slow simulated backend (the slow one
// prefills 40 ms longer) and a proxy whose route "split" sends to both.
func twoBackends(t *testing.T, edit func(*Route)) *testProxy {
	t.Helper()
	tp, _ := twoBackendsHeld(t, edit)
	return tp
}

// twoBackendsHeld is twoBackends whose streams that ask for it
// ("mock_hold": true) stay open after their first token until the
// returned channel is closed.
func twoBackendsHeld(t *testing.T, edit func(*Route)) (*testProxy, chan struct{}) {
	t.Helper()
	hold := make(chan struct{})
	fast := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond, Hold: hold})
	slow := startMock(t, mockllm.Options{PrefillBase: 45 * time.Millisecond, TokenGap: time.Millisecond, Hold: hold})
	return startProxy(t, "", func(c *Config) {
		r := Route{Name: "split", Prefix: "/", Timeouts: DefaultTimeouts, Upstreams: []Upstream{
			{Name: "stable", URL: fast, Weight: 3}, {Name: "canary", URL: slow, Weight: 1}}}
		if edit != nil {
			edit(&r)
		}
		c.Routes = []Route{r}
		c.Models = []string{"m"}
	}), hold
}

func chat(t *testing.T, url string, header ...string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(streamChat))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
}

// TestWeightedSplit: 400 requests split 3:1 within four standard
// deviations of the binomial, each upstream measured apart (its own
// /stats group with its backend's first-token time, the access log's
// upstream, metrics labelled upstream).
func TestWeightedSplit(t *testing.T) {
	wait.Long(t, "thousands of requests split by weight")
	tp := twoBackends(t, nil)
	const n = 400
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n / 8 {
				chat(t, tp.url)
			}
		}()
	}
	wg.Wait()
	count := map[string]int{}
	for range n {
		r := tp.rec.next(t)
		count[r.Upstream]++
	}
	// Binomial(400, 0.25): mean 100, standard deviation 8.7.
	if c := count["canary"]; c < 65 || c > 135 || count["stable"] != n-c {
		t.Errorf("split %v, want about 300/100", count)
	}
	rep := tp.p.Stats().Query(stats.Query{Window: "all", GroupBy: []string{"route", "upstream"}})
	if len(rep.Groups) != 2 {
		t.Fatalf("groups %+v", rep.Groups)
	}
	for _, g := range rep.Groups {
		if int(g.Count) != count[g.Upstream] {
			t.Errorf("%s: /stats count %d, records %d", g.Upstream, g.Count, count[g.Upstream])
		}
		// Each at least its backend's prefill.
		if lo := map[string]float64{"stable": 5, "canary": 45}[g.Upstream]; g.TTFT.P50 < lo {
			t.Errorf("%s: TTFT p50 %.1f ms, under its backend's %.0f ms", g.Upstream, g.TTFT.P50, lo)
		}
	}
	// The canary prefills 40 ms longer: its TTFT is that much more, were
	// the groups mixed they would be alike. (A bound on each alone fails
	// when a busy machine adds 30 ms to both.)
	byName := map[string]float64{}
	for _, g := range rep.Groups {
		byName[g.Upstream] = g.TTFT.P50
	}
	if d := byName["canary"] - byName["stable"]; d < 25 {
		t.Errorf("TTFT p50 canary %.1f ms, stable %.1f ms: %.1f ms apart, want about 40", byName["canary"], byName["stable"], d)
	}
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, u := range []string{"stable", "canary"} {
		if !strings.Contains(b.String(), fmt.Sprintf(`tokentap_ttft_seconds_count{route="split",upstream=%q,model="other"}`, u)) {
			t.Errorf("no TTFT series labelled upstream %q", u)
		}
	}
}

// TestStickyTenantAndHeader: a sticky key always lands on one upstream,
// and different keys spread over both.
func TestStickyTenantAndHeader(t *testing.T) {
	wait.Long(t, "thousands of requests split by weight")
	for _, sticky := range []string{"tenant", "header:X-User"} {
		t.Run(sticky, func(t *testing.T) {
			tp := twoBackends(t, func(r *Route) { r.Sticky = sticky; r.Upstreams[1].Weight = 3 })
			if sticky == "tenant" {
				var tenants []ratelimit.Tenant
				for i := range 12 {
					tenants = append(tenants, ratelimit.Tenant{Name: fmt.Sprintf("t%d", i), Keys: []string{fmt.Sprintf("key-%02d-0123456789abcdef", i)}})
				}
				cfg := tp.p.snap.Load().cfg
				cfg.Admission = &ratelimit.Config{Mode: ratelimit.ModeReject, Tenants: tenants}
				if err := tp.p.Apply(cfg); err != nil {
					t.Fatal(err)
				}
			}
			seen := map[string]map[string]bool{} // key → upstreams
			for i := range 12 {
				for range 4 {
					if sticky == "tenant" {
						chat(t, tp.url, "Authorization", fmt.Sprintf("Bearer key-%02d-0123456789abcdef", i))
					} else {
						chat(t, tp.url, "X-User", fmt.Sprintf("user-%d", i))
					}
					r := tp.rec.next(t)
					k := fmt.Sprint(i)
					if seen[k] == nil {
						seen[k] = map[string]bool{}
					}
					seen[k][r.Upstream] = true
				}
			}
			used := map[string]bool{}
			for k, ups := range seen {
				if len(ups) != 1 {
					t.Errorf("key %s went to %v", k, ups)
				}
				for u := range ups {
					used[u] = true
				}
			}
			if len(used) != 2 {
				t.Errorf("12 keys all on %v", used)
			}
		})
	}
}

// TestLeastInflight: with the slow upstream holding streams, new requests
// go to the one with fewer in flight.
func TestLeastInflight(t *testing.T) {
	tp, hold := twoBackendsHeld(t, func(r *Route) { r.Balance = BalanceLeastInflight; r.Upstreams[1].Weight = 1 })
	// Hold one stream open on whichever upstream the first request gets,
	// until the other requests are done.
	held := holdStream(t, tp)
	first := ""
	waitUntil(t, func() bool {
		for _, m := range tp.p.snap.Load().routes[0].set.Members() {
			if m.Up.Inflight.Load() == 1 {
				first = m.Name
			}
		}
		return first != ""
	})
	for range 5 {
		chat(t, tp.url)
	}
	for range 5 {
		if r := tp.rec.next(t); r.Upstream == first {
			t.Errorf("a request went to %s, which holds a stream, while the other was idle", first)
		}
	}
	close(hold)
	<-held
	if r := tp.rec.next(t); r.Upstream != first || r.Outcome != metrics.OutcomeOK {
		t.Errorf("the held stream: %+v", r)
	}
}

// holdStream sends a stream that the backend holds open after its first
// token ("mock_hold"); the channel closes when its client has read it all.
func holdStream(t *testing.T, tp *testProxy) chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		body := `{"model":"m","stream":true,"max_tokens":3,"mock_hold":true,"messages":[{"role":"user","content":"hi"}]}`
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Error(err)
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}()
	return done
}

// TestWeightsChangeOnReload: a reload that moves all weight to the other
// upstream sends new requests there, while a stream that started before
// it finishes on its upstream.
func TestWeightsChangeOnReload(t *testing.T) {
	tp, hold := twoBackendsHeld(t, func(r *Route) { r.Upstreams[0].Weight, r.Upstreams[1].Weight = 1, 0 })
	held := holdStream(t, tp)
	waitUntil(t, func() bool { return tp.p.snap.Load().routes[0].set.Members()[0].Up.Inflight.Load() == 1 })
	cfg := tp.p.snap.Load().cfg
	cfg.Routes[0].Upstreams = []Upstream{{Name: "stable", URL: cfg.Routes[0].Upstreams[0].URL, Weight: 0}, {Name: "canary", URL: cfg.Routes[0].Upstreams[1].URL, Weight: 1}}
	if err := tp.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	chat(t, tp.url)
	close(hold)
	<-held
	got := map[string]metrics.Record{}
	for range 2 {
		r := tp.rec.next(t)
		got[r.Upstream] = r
	}
	if r, ok := got["stable"]; !ok || r.Outcome != metrics.OutcomeOK || r.Events != 3 {
		t.Errorf("the stream that began before the reload: %+v", r)
	}
	if _, ok := got["canary"]; !ok {
		t.Errorf("the request after the reload did not go to canary: %v", got)
	}
}

// One rule picks the sides every comparison view weighs: a guard's
// baseline and candidate whatever the weights or the traffic (tokentap
// compare took the busier upstream as the baseline and printed a canary
// 2.6 times slower as 62% faster); a route's main upstream and its shadow;
// else the two of largest weight, the larger as A.
func TestCompareSides(t *testing.T) {
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{
			{Name: "guarded", Prefix: "/g", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "canary", URL: "http://127.0.0.1:1", Weight: 9}, {Name: "stable", URL: "http://127.0.0.1:2", Weight: 1}},
				Guard:     &Guard{Candidate: "canary", Baseline: "stable", MinRequests: 10, MaxTTFTP95Increase: 0.1}},
			{Name: "shadowed", Prefix: "/s", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "next", URL: "http://127.0.0.1:1", Weight: 0}, {Name: "live", URL: "http://127.0.0.1:2", Weight: 1}},
				Shadow:    &Shadow{Upstream: "next", Sample: 0.1}},
			{Name: "weighted", Prefix: "/w", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "small", URL: "http://127.0.0.1:1", Weight: 1}, {Name: "big", URL: "http://127.0.0.1:2", Weight: 3}, {Name: "mid", URL: "http://127.0.0.1:3", Weight: 2}}},
			{Name: "one", Prefix: "/o", Timeouts: DefaultTimeouts, Upstream: "http://127.0.0.1:1"},
		}
	})
	for _, c := range []struct{ route, a, b, rule string }{
		{"guarded", "stable", "canary", "guard"},
		{"shadowed", "live", "next", "shadow"},
		{"weighted", "big", "mid", "largest weight"},
	} {
		a, b, rule, ok := tp.p.CompareSides(c.route)
		if !ok || a != c.a || b != c.b || !strings.Contains(rule, c.rule) {
			t.Errorf("%s: A %s, B %s (%s), want %s and %s by its %s", c.route, a, b, rule, c.a, c.b, c.rule)
		}
	}
	if _, _, _, ok := tp.p.CompareSides("one"); ok {
		t.Error("a route of one upstream has sides to compare")
	}
}

// TestQueuedRequestsNotCountedAtTheirUpstream: a tenant of max_concurrent
// 1 in queue mode holds one stream open and sends three more, which wait
// in its queue. While they wait the route's upstreams count one request in
// flight, not four (least_inflight, least_ttft and overload read that
// count): a request is counted at its upstream once its tenant admits it.
// Once the stream ends the three are served, one after another, each
// counted then.
func TestQueuedRequestsNotCountedAtTheirUpstream(t *testing.T) {
	tp, hold := twoBackendsHeld(t, func(r *Route) { r.Balance = BalanceLeastInflight })
	cfg := tp.p.snap.Load().cfg
	cfg.Admission = &ratelimit.Config{Tenants: []ratelimit.Tenant{{Name: "q", Keys: []string{"kq"}, Limits: ratelimit.Limits{MaxConcurrent: 1}}},
		Mode: ratelimit.ModeQueue, MaxQueue: 10, MaxWait: time.Minute}
	if err := tp.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	inflight := func() (n int64) {
		for _, m := range tp.p.snap.Load().routes[0].set.Members() {
			n += m.Up.Inflight.Load()
		}
		return n
	}
	send := func(body string) chan int {
		done := make(chan int, 1)
		go func() {
			resp, _ := postKey(t, tp.url+"/v1/chat/completions", "kq", body)
			done <- resp.StatusCode
		}()
		return done
	}
	held := send(`{"model":"m","stream":true,"max_tokens":3,"mock_hold":true,"messages":[{"role":"user","content":"hi"}]}`)
	waitUntil(t, func() bool { return inflight() == 1 })
	var queued []chan int
	for range 3 {
		queued = append(queued, send(streamChat))
	}
	waitFor(t, func() error {
		if _, q := tp.p.snap.Load().admit.Stats("q"); q != 3 {
			return fmt.Errorf("%d queued", q)
		}
		return nil
	})
	if n := inflight(); n != 1 {
		t.Errorf("with one stream open and three requests in its tenant's queue, the upstreams count %d in flight, want 1", n)
	}
	close(hold)
	for i, c := range append(queued, held) {
		if status := <-c; status != 200 {
			t.Errorf("request %d: %d", i, status)
		}
	}
	for range 4 {
		tp.rec.next(t)
	}
	waitUntil(t, func() bool { return inflight() == 0 })
}
