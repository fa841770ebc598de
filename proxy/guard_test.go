package proxy

import (
	"fmt"

	"bytes"
	"github.com/valyala/fasthttp"
	"strings"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/examples/mockllm"
)

// TestCanaryGuard: a canary whose first token comes 40 ms later than its
// baseline's (10 ms) trips a guard allowing +100% on TTFT p95 once a
// window of data is in; it then takes no new requests until reset. An equal canary never
// trips it.
func TestCanaryGuard(t *testing.T) {
	for _, slower := range []bool{true, false} {
		clk := &offsetClock{}
		fast := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: time.Millisecond})
		canaryPrefill := 10 * time.Millisecond
		if slower {
			canaryPrefill = 50 * time.Millisecond
		}
		canary := startMock(t, mockllm.Options{PrefillBase: canaryPrefill, TokenGap: time.Millisecond})
		route := "guarded"
		if !slower {
			route = "guarded-equal"
		}
		tp := startProxyOpts(t, "", func(c *Config) {
			c.Routes = []Route{{Name: route, Prefix: "/", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "stable", URL: fast, Weight: 1}, {Name: "canary", URL: canary, Weight: 1}},
				// +100%: the slow canary is 4× its baseline, an equal one
				// stays far from it even on a busy machine.
				Guard: &Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 30, MaxTTFTP95Increase: 1}}}
		}, Options{StatsNow: clk.now})
		// The guard weighs a window only once a whole one passed since
		// the config: the traffic lands late in the first minute.
		clk.jump(50 * time.Second)
		for range 80 {
			chat(t, tp.url)
			tp.rec.next(t)
		}
		if g := tp.p.Guards(); len(g) != 0 {
			t.Fatalf("tripped before a window passed: %+v", g)
		}
		clk.jump(15 * time.Second)
		for range 4 {
			chat(t, tp.url)
			tp.rec.next(t)
			time.Sleep(guardInterval / 3)
		}
		guards := tp.p.Guards()
		if !slower {
			if len(guards) != 0 {
				t.Fatalf("an equal canary tripped the guard: %+v", guards)
			}
			continue
		}
		if len(guards) != 1 || guards[0].Candidate != "canary" || !strings.Contains(guards[0].Reason, "TTFT p95") ||
			guards[0].Values["candidate_ttft_p95_ms"] < guards[0].Values["baseline_ttft_p95_ms"]*2 {
			t.Fatalf("guards %+v", guards)
		}
		var b bytes.Buffer
		vm.WritePrometheus(&b, false)
		if !strings.Contains(b.String(), `tokentap_guard_tripped{route="guarded",upstream="canary"} 1`) {
			t.Errorf("gauge not 1")
		}
		for range 20 {
			chat(t, tp.url)
			if r := tp.rec.next(t); r.Upstream != "stable" {
				t.Fatalf("a request went to %s after the guard tripped", r.Upstream)
			}
		}
		if !tp.p.ResetGuard(route) || len(tp.p.Guards()) != 0 {
			t.Fatal("reset did not clear the guard")
		}
		seen := map[string]bool{}
		for range 30 {
			chat(t, tp.url)
			seen[tp.rec.next(t).Upstream] = true
		}
		if !seen["canary"] {
			t.Errorf("after the reset the canary took no request: %v", seen)
		}
	}
}

// TestGuardNotSteeredByOneKey: with sticky: header:X-User a client chooses
// its side. One user whose every request goes to the canary (and finds it
// slow) cannot trip the guard alone: a side is weighed only with the
// requests of min_keys (10) distinct users in its window. When as slow a
// canary is seen by twelve users, it trips.
func TestGuardNotSteeredByOneKey(t *testing.T) {
	clk := &offsetClock{}
	fast := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: time.Millisecond})
	slow := startMock(t, mockllm.Options{PrefillBase: 50 * time.Millisecond, TokenGap: time.Millisecond})
	tp := startProxyOpts(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "steered", Prefix: "/", Timeouts: DefaultTimeouts, Sticky: "header:X-User",
			Upstreams: []Upstream{{Name: "stable", URL: fast, Weight: 1}, {Name: "canary", URL: slow, Weight: 1}},
			Guard:     &Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 30, MaxTTFTP95Increase: 1}}}
	}, Options{StatsNow: clk.now})
	// Users that the sticky hash sends to each side.
	users := map[string][]string{}
	rt := tp.p.snap.Load().routes[0]
	for i := 0; len(users["canary"]) < 12 || len(users["stable"]) < 12; i++ {
		var h fasthttp.RequestHeader
		u := fmt.Sprintf("user-%d", i)
		h.Set("X-User", u)
		m, _, _ := rt.pick("", &h)
		users[m.name] = append(users[m.name], u)
	}
	send := func(n int, who []string) {
		for i := range n {
			chat(t, tp.url, "X-User", who[i%len(who)])
			tp.rec.next(t)
		}
	}
	check := func() {
		// The guard weighs at most once a second of its clock.
		clk.jump(2 * time.Second)
		send(1, users["stable"])
	}
	clk.jump(50 * time.Second) // a whole window after the config, as TestCanaryGuard
	send(40, users["stable"])
	send(40, users["canary"][:1]) // one user, all of the canary's requests
	clk.jump(15 * time.Second)
	check()
	if g := tp.p.Guards(); len(g) != 0 {
		t.Fatalf("one user tripped the guard: %+v", g)
	}
	send(40, users["canary"])
	check()
	if g := tp.p.Guards(); len(g) != 1 || g[0].Candidate != "canary" {
		t.Fatalf("twelve users saw the slow canary, the guard did not trip: %+v", g)
	}
}
