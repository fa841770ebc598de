package proxy

import (
	"bytes"
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
