package proxy

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// TestShadowStallsAddNothing: every request is copied to a shadow that
// holds each copy for 800 ms before answering. The clients' requests run
// at the primary's pace, copies beyond max_inflight are skipped and
// counted, and each copy sent gets a record of its own (shadow, the
// request id with a suffix, its upstream) in its upstream's /stats group,
// never in the route's goodput.
func TestShadowStallsAddNothing(t *testing.T) {
	primary := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	stall := make(chan struct{})
	shadow := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		select {
		case <-stall:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range []string{chatChunk("a"), chatChunk("b"), "data: [DONE]\n\n"} {
			io.WriteString(w, c)
			flush(w)
			time.Sleep(2 * time.Millisecond)
		}
	})
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "shadowed", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "live", URL: primary, Weight: 1}, {Name: "next", URL: shadow.URL, Weight: 0}},
			Shadow:    &Shadow{Upstream: "next", Sample: 1, MaxInflight: 3}}}
		c.SLO = metrics.SLO{TTFT: 5 * time.Second}
	})
	const n = 10
	skippedBefore := failoverCountName(`tokentap_shadow_skipped_total{route="shadowed",reason="max_inflight"} `)
	for range n {
		// The shadow stalls until the loop is over: a request that waited
		// for its copy would never end.
		done := make(chan struct{})
		go func() { chat(t, tp.url); close(done) }()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Fatal("a request waits for its stalled shadow")
		}
		r := tp.rec.next(t)
		if r.Shadow || r.Upstream != "live" || !r.SLOJudged || r.Outcome != metrics.OutcomeOK {
			t.Errorf("primary record %+v", r)
		}
	}
	close(stall)
	shadows := 0
	for range 3 {
		r := tp.rec.next(t)
		if !r.Shadow || r.Upstream != "next" || !strings.HasSuffix(r.RequestID, "-shadow") || r.SLOJudged || r.Events != 2 || r.TTFT < 0 {
			t.Errorf("shadow record %+v", r)
		}
		shadows++
	}
	tp.rec.none(t)
	rep := tp.p.Stats().Query(stats.Query{Window: "all", GroupBy: []string{"route", "upstream"}})
	for _, g := range rep.Groups {
		switch g.Upstream {
		case "live":
			if g.Count != n || g.Goodput.Judged != n {
				t.Errorf("live group %+v", g)
			}
		case "next":
			if g.Count != int64(shadows) || g.Goodput.Judged != 0 || g.TTFT.Count != int64(shadows) {
				t.Errorf("shadow group %+v", g)
			}
		}
	}
	if got := failoverCountName(`tokentap_shadow_skipped_total{route="shadowed",reason="max_inflight"} `) - skippedBefore; got != n-3 {
		t.Errorf("skipped %d copies, want %d", got, n-3)
	}
}

// TestShadowOnlyInItsUpstreamsGroup: with every request copied to a shadow,
// the route's and the tenants' figures count each client request once, at
// the primary's times; the copies show only where groups keep the upstream
// label, as a group of their own marked shadow, and never on the route's
// timeline.
func TestShadowOnlyInItsUpstreamsGroup(t *testing.T) {
	primary := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	shadow := startMock(t, mockllm.Options{PrefillBase: 80 * time.Millisecond, TokenGap: time.Millisecond})
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "copied", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "live", URL: primary, Weight: 1}, {Name: "next", URL: shadow, Weight: 0}},
			Shadow:    &Shadow{Upstream: "next", Sample: 1, MaxInflight: 100}}}
		c.Models = []string{"m"}
		c.SLO = metrics.SLO{TTFT: 5 * time.Second}
	})
	const n = 10
	for range n {
		chat(t, tp.url)
	}
	var primaryTTFT time.Duration
	for range 2 * n {
		if r := tp.rec.next(t); !r.Shadow && r.TTFT > primaryTTFT {
			primaryTTFT = r.TTFT
		}
	}
	q := func(groupBy ...string) []stats.Group {
		return tp.p.Stats().Query(stats.Query{Window: "all", GroupBy: groupBy}).Groups
	}
	for _, by := range [][]string{{"route"}, {"tenant"}, {"model"}, {"route", "model", "tenant"}} {
		gs := q(by...)
		if len(gs) != 1 || gs[0].Count != n || gs[0].Shadow || gs[0].Goodput.Judged != n || gs[0].TTFT.Max > ms(primaryTTFT)*1.01 {
			t.Errorf("group_by %v: %+v", by, gs)
		}
	}
	for _, by := range [][]string{nil, {"upstream"}, {"route", "upstream"}} {
		var live, next int64
		for _, g := range q(by...) {
			switch {
			case g.Upstream == "live" && !g.Shadow:
				live += g.Count
			case g.Upstream == "next" && g.Shadow && g.Goodput.Judged == 0:
				next += g.Count
			default:
				t.Errorf("group_by %v: %+v", by, g)
			}
		}
		if live != n || next != n {
			t.Errorf("group_by %v: live %d, shadow %d, want %d each", by, live, next, n)
		}
	}
	var onTimeline int64
	for _, rt := range tp.p.Stats().Timeline("copied").Routes {
		for _, p := range rt.Points {
			onTimeline += p.Count
		}
	}
	if onTimeline != n {
		t.Errorf("the route's timeline counts %d requests, want %d", onTimeline, n)
	}
}

// A shadow copy holds a copy of the request body for as long as it runs:
// it counts in max_buffered_bodies and is skipped (counted) when the budget
// is spent. 16 requests of 1.9 MiB against a 2 MiB budget were all copied
// (RSS 30 → 78 MB); now the copies wait for nothing and hold nothing, and
// with a budget that fits them the bytes held never pass it.
func TestShadowCopiesInTheBodyBudget(t *testing.T) {
	primary := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"choices":[{"message":{"content":"ok"}}]}`)
	})
	release := make(chan struct{})
	var copies atomic.Int64
	shadow := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		copies.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
		io.WriteString(w, `{}`)
	})
	unblock := sync.OnceFunc(func() { close(release) })
	for _, c := range []struct {
		budget       int64
		body         int
		copiesAtMost int64
	}{
		{2 << 20, 1900 << 10, 0}, // the request itself holds most of the budget
		{8 << 20, 1 << 20, 7},    // copies until the budget is spent
	} {
		tp := startProxyOpts(t, "", func(cfg *Config) {
			cfg.Routes = []Route{{Name: "budget", Prefix: "/", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "live", URL: primary.URL, Weight: 1}, {Name: "next", URL: shadow.URL, Weight: 0}},
				Shadow:    &Shadow{Upstream: "next", Sample: 1, MaxInflight: 16}}}
		}, Options{MaxBufferedBodies: c.budget})
		t.Cleanup(unblock)
		skipped := failoverCountName(`tokentap_shadow_skipped_total{route="budget",reason="body_budget"} `)
		copies.Store(0)
		body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", c.body) + `"}]}`
		for i := range 16 {
			resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("budget %d: request %d answered %d", c.budget, i, resp.StatusCode)
			}
			if held := tp.p.bodies.Load(); held > c.budget {
				t.Fatalf("budget %d: %d bytes of bodies held", c.budget, held)
			}
		}
		// Each request's copy is sent or skipped as the request is served;
		// those sent reach the shadow on goroutines of their own.
		var sent int64
		var got int
		waitFor(t, func() error {
			sent = copies.Load()
			got = failoverCountName(`tokentap_shadow_skipped_total{route="budget",reason="body_budget"} `) - skipped
			if int64(got)+sent < 16 {
				return fmt.Errorf("%d copies sent and %d skipped of 16", sent, got)
			}
			return nil
		})
		t.Logf("budget %d MiB, bodies of %d KiB: %d copies sent, %d skipped for the budget, %d bytes held", c.budget>>20, c.body>>10, sent, got, tp.p.bodies.Load())
		if sent > c.copiesAtMost || int64(got) != 16-sent {
			t.Fatalf("%d copies sent (at most %d), %d skipped for the budget (want the other %d)", sent, c.copiesAtMost, got, 16-sent)
		}
		if c.copiesAtMost > 0 && sent == 0 {
			t.Fatal("no copy sent though the budget fits some")
		}
	}
	unblock()
}

// TestStalledShadowLetsItsBodyGo: a shadow upstream that never answers,
// and a copy's timeout of 300 ms: the copy is cut then, its record says
// so, and its copy of the body leaves the budget of buffered bodies,
// where before it stayed until the route's first-byte timeout (10
// minutes).
func TestStalledShadowLetsItsBodyGo(t *testing.T) {
	wait.Long(t, "a shadow copy's timeout")
	primary := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	stalled := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	})
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "shadowed", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "live", URL: primary, Weight: 1}, {Name: "next", URL: stalled.URL, Weight: 0}},
			Shadow:    &Shadow{Upstream: "next", Sample: 1, Timeout: 300 * time.Millisecond}}}
	})
	big := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 100_000) + `"}]}`
	if status, _ := ask(t, tp.url, "/v1/chat/completions", big); status != 200 {
		t.Fatalf("primary: %d", status)
	}
	r := tp.rec.next(t) // the two records in either order
	if !r.Shadow {
		r = tp.rec.next(t)
	}
	if !r.Shadow || r.Outcome != metrics.OutcomeUpstreamTimeout || !strings.Contains(r.Error, "shadow.timeout") {
		t.Errorf("the stalled copy's record: shadow %v, %s %q", r.Shadow, r.Outcome, r.Error)
	}
	waitFor(t, func() error {
		if n := tp.p.bodies.Load(); n != 0 {
			return fmt.Errorf("%d body bytes still held", n)
		}
		return nil
	})
}
