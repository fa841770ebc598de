package proxy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/valyala/fasthttp"
)

// TestCanaryGuard: a canary whose first token comes 140 ms later than its
// baseline's (10 ms) trips a guard allowing +100% on TTFT p95 at one of its
// first looks once both sides have min_requests since the config (no
// window to wait for: the stats clock never moves past the real one here),
// with the limit judged against the ratio's lower confidence bound; never
// before both sides have min_requests. It then takes no new requests until
// reset. An equal canary never trips it, look after look.
func TestCanaryGuard(t *testing.T) {
	const minRequests = 80
	for _, slower := range []bool{true, false} {
		fast := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: time.Millisecond})
		canaryPrefill := 10 * time.Millisecond
		if slower {
			canaryPrefill = 150 * time.Millisecond
		}
		canary := startMock(t, mockllm.Options{PrefillBase: canaryPrefill, TokenGap: time.Millisecond})
		route := "guarded"
		if !slower {
			route = "guarded-equal"
		}
		tp := startProxyOpts(t, "", func(c *Config) {
			c.Routes = []Route{{Name: route, Prefix: "/", Timeouts: DefaultTimeouts,
				Upstreams: []Upstream{{Name: "stable", URL: fast, Weight: 1}, {Name: "canary", URL: canary, Weight: 1}},
				// +100%: the slow canary is 15× its baseline, an equal one
				// stays far from it even on a busy machine.
				Guard: &Guard{Candidate: "canary", Baseline: "stable", Window: "1h", MinRequests: minRequests, MaxTTFTP95Increase: 1}}}
		}, Options{})
		g := func() GuardState { return tp.p.GuardStates()[0] }
		perSide := map[string]int{}
		const batch = 8
		for i := 0; ; i++ {
			if i == 200 {
				t.Fatalf("200 batches: sides %v, %d looks, guards %+v", perSide, g().Looks, tp.p.Guards())
			}
			var wg sync.WaitGroup
			for range batch {
				wg.Go(func() { chat(t, tp.url) })
			}
			wg.Wait()
			for range batch {
				perSide[tp.rec.next(t).Upstream]++
			}
			low := min(perSide["stable"], perSide["canary"])
			tripped := len(tp.p.Guards()) > 0
			if tripped && low < minRequests-batch {
				t.Fatalf("tripped with sides %v, under min_requests %d", perSide, minRequests)
			}
			if tripped || (!slower && g().Looks >= 3) {
				break
			}
		}
		guards := tp.p.Guards()
		if !slower {
			if len(guards) != 0 {
				t.Fatalf("an equal canary tripped the guard: %+v", guards)
			}
			continue
		}
		if len(guards) != 1 || guards[0].Candidate != "canary" || !strings.Contains(guards[0].Reason, "TTFT p95") ||
			guards[0].Values["ratio_lower_bound_ttft_p95"] <= 2 || guards[0].Values["look"] > 3 {
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
		if st := g(); st.Looks != 0 || st.CandidateRequests != 0 || st.BaselineRequests != 0 {
			t.Fatalf("the reset kept %d looks and %d and %d requests", st.Looks, st.CandidateRequests, st.BaselineRequests)
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
// requests of min_keys (10) distinct users since the guard was armed.
// When as slow a canary is seen by twelve users, it trips at the first
// look.
func TestGuardNotSteeredByOneKey(t *testing.T) {
	clk := &offsetClock{}
	fast := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: time.Millisecond})
	// 15x the baseline, as in TestCanaryGuard: a busy machine's delay on
	// both sides cannot close the gap to the +100% limit (5x could).
	slow := startMock(t, mockllm.Options{PrefillBase: 150 * time.Millisecond, TokenGap: time.Millisecond})
	tp := startProxyOpts(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "steered", Prefix: "/", Timeouts: DefaultTimeouts, Sticky: "header:X-User",
			Upstreams: []Upstream{{Name: "stable", URL: fast, Weight: 1}, {Name: "canary", URL: slow, Weight: 1}},
			Guard:     &Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 80, MaxTTFTP95Increase: 1}}}
	}, Options{StatsNow: clk.now})
	users := usersBySide(tp, 12)
	send := func(n int, who []string) {
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Go(func() {
				for i := w; i < n; i += 8 {
					chat(t, tp.url, "X-User", who[i%len(who)])
				}
			})
		}
		wg.Wait()
		for range n {
			tp.rec.next(t)
		}
	}
	check := func() {
		// The guard weighs at most once a second of its clock.
		clk.jump(2 * time.Second)
		send(1, users["stable"])
	}
	send(100, users["stable"])
	send(100, users["canary"][:1]) // one user, all of the canary's requests
	check()
	if g := tp.p.Guards(); len(g) != 0 {
		t.Fatalf("one user tripped the guard: %+v", g)
	}
	send(100, users["canary"])
	check()
	if g := tp.p.Guards(); len(g) != 1 || g[0].Candidate != "canary" || g[0].Values["look"] != 1 {
		t.Fatalf("twelve users saw the slow canary, the guard did not trip at its first look: %+v (guard %+v)", g, tp.p.GuardStates())
	}
}

// TestGuardLeavesOutClientTime: two equal backends, and every client of
// the canary is slow on its own side of the wire: it takes 150 ms to send
// its request's body, and once the response's header is in it stops
// reading for 300 ms, while the 1 MB stream fills the socket buffers
// between them. What those users lived (ttft_ms, e2e_ms) is far worse
// than the baseline's, but none of it is the canary's doing: the guard
// weighs TTFT and E2E without the upload, the admission queue and the
// writes that waited for the client (client_stall_ms), and does not trip.
// The same slow clients in front of a canary that is really 50x slower to
// its first token (500 ms against 10) do trip it (the limits: +200%).
func TestGuardLeavesOutClientTime(t *testing.T) {
	event := "data: " + `{"choices":[{"delta":{"content":"` + strings.Repeat("x", 960) + `"}}]}` + "\n\n"
	stream := []byte(strings.Repeat(event, 1000))
	backend := func(prefill time.Duration) string {
		return startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.ReadAll(r.Body)
			w.Header().Set("Content-Type", "text/event-stream")
			time.Sleep(prefill)
			_, _ = w.Write(stream)
		}).URL
	}
	for _, slowCanary := range []bool{false, true} {
		clk := &offsetClock{}
		base, canary := backend(10*time.Millisecond), backend(10*time.Millisecond)
		if slowCanary {
			canary = backend(500 * time.Millisecond)
		}
		rec := newRecorder()
		p, err := New(Config{Routes: []Route{{Name: "slowclients", Prefix: "/", Timeouts: DefaultTimeouts, Sticky: "header:X-User",
			Upstreams: []Upstream{{Name: "stable", URL: base, Weight: 1}, {Name: "canary", URL: canary, Weight: 1}},
			Guard: &Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 80,
				MaxTTFTP95Increase: 2, MaxE2EP95Increase: 2}}}}, Options{StatsNow: clk.now, Sinks: []metrics.Sink{rec}})
		if err != nil {
			t.Fatal(err)
		}
		// Client connections inherit the listener's send buffer: 256 KiB,
		// not the megabytes loopback grows it to, so a client that does not
		// read holds tokentap's writes.
		lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
			return c.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF, 128<<10) })
		}}
		ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		go func() { _ = p.Serve(ln) }()
		t.Cleanup(func() { _ = p.Shutdown(context.Background()); p.Close() })
		tp := &testProxy{p: p, addr: ln.Addr().String(), rec: rec}
		users := usersBySide(tp, 12)
		const perSide = 100
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := w; i < perSide; i += 8 {
					if err := streamClient(tp.addr, users["stable"][i%12], 0, 0); err != nil {
						t.Error(err)
					}
					if err := streamClient(tp.addr, users["canary"][i%12], 150*time.Millisecond, 300*time.Millisecond); err != nil {
						t.Error(err)
					}
				}
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		e2e := map[string][]time.Duration{}
		stalled := 0
		for range 2 * perSide {
			r := tp.rec.next(t)
			e2e[r.Upstream] = append(e2e[r.Upstream], r.E2E)
			if r.Upstream == "canary" && os.Getenv("TOKENTAP_GUARD_DEBUG") != "" {
				t.Logf("canary: ttft %v e2e %v upload %v stall %v (%v before the first token)", r.TTFT, r.E2E, r.Upload, r.ClientStall, r.ClientStallTTFT)
			}
			if r.Upstream == "canary" && r.ClientStall >= 100*time.Millisecond && r.Upload >= 100*time.Millisecond {
				stalled++
			}
		}
		// The users' own figures hold the time the slow clients caused:
		// 150 ms of upload and 300 ms of not reading on every canary
		// request (else this test would not test).
		if stalled < perSide*3/4 {
			t.Fatalf("slow clients: %d of 100 records with a stall and a slow upload; e2e p95 canary %v, stable %v", stalled, p95(e2e["canary"]), p95(e2e["stable"]))
		}
		for i := range 2 {
			// The guard weighs at most once a second of its clock.
			clk.jump(2 * time.Second)
			if err := streamClient(tp.addr, users["stable"][i], 0, 0); err != nil {
				t.Fatal(err)
			}
			tp.rec.next(t)
		}
		g := tp.p.Guards()
		switch {
		case !slowCanary && len(g) != 0:
			t.Fatalf("slow clients tripped the guard of an equal canary: %+v", g)
		case slowCanary && (len(g) != 1 || !strings.Contains(g[0].Reason, "TTFT p95")):
			t.Fatalf("a canary 50x slower to its first token, behind slow clients, did not trip the guard on TTFT: %+v (guard %+v)",
				g, tp.p.GuardStates())
		}
	}
}

// streamClient sends one streamed chat as user, its body upload after its
// header, and once the response's header is in stops reading for pause.
func streamClient(addr, user string, upload, pause time.Duration) error {
	// A receive buffer of its own size: the kernel's would grow to hold
	// the whole stream on loopback.
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 128<<10) })
	}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	const body = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`
	req := postJSON("/v1/chat/completions", body, "X-User: "+user)
	head := req[:len(req)-len(body)]
	if _, err := io.WriteString(c, head); err != nil {
		return err
	}
	time.Sleep(upload)
	if _, err := io.WriteString(c, body); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(time.Minute))
	br := bufio.NewReaderSize(c, 4096)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return err
	}
	time.Sleep(pause)
	n, err := io.Copy(io.Discard, resp.Body)
	if err != nil || resp.StatusCode != 200 {
		return fmt.Errorf("status %d after %d bytes: %v", resp.StatusCode, n, err)
	}
	return nil
}

func p95(v []time.Duration) time.Duration {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[(len(s)*95+99)/100-1]
}

// usersBySide returns n X-User values that the first route's sticky hash
// sends to each of its upstreams "stable" and "canary".
func usersBySide(tp *testProxy, n int) map[string][]string {
	users := map[string][]string{}
	rt := tp.p.snap.Load().routes[0]
	for i := 0; len(users["canary"]) < n || len(users["stable"]) < n; i++ {
		var h fasthttp.RequestHeader
		u := fmt.Sprintf("user-%d", i)
		h.Set("X-User", u)
		m := rt.set.Choose(&routing.Request{Header: &h}).Member
		users[m.Name] = append(users[m.Name], u)
	}
	return users
}

// TestGuardStopsAFiftyPercentSlowerCanary: through tokentap, against
// simulated backends, a canary whose first token comes 50% later (150 ms
// against 100) under a guard allowing +10% with min_requests 200 is
// stopped before either side has 4 × min_requests, and no request goes to
// it after. The bound is on requests, which the test sends, not on looks,
// which come once a second: a busy machine serves fewer requests a second,
// so it looks more often for the same evidence (it tripped at look 5 on
// one, where an idle one trips at look 1).
func TestGuardStopsAFiftyPercentSlowerCanary(t *testing.T) {
	base := startMock(t, mockllm.Options{PrefillBase: 100 * time.Millisecond, TokenGap: time.Millisecond})
	slow := startMock(t, mockllm.Options{PrefillBase: 150 * time.Millisecond, TokenGap: time.Millisecond})
	tp := startProxyOpts(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "fifty", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "stable", URL: base, Weight: 1}, {Name: "canary", URL: slow, Weight: 1}},
			Guard:     &Guard{Candidate: "canary", Baseline: "stable", MinRequests: 200, MaxTTFTP95Increase: 0.1, MaxE2EP95Increase: 0.1}}}
	}, Options{})
	g := func() GuardState { return tp.p.GuardStates()[0] }
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				chat(t, tp.url)
			}
		})
	}
	var reached time.Time // when both sides had min_requests
	perSide := map[string]int{}
	afterTrip := 0
	for deadline := time.Now().Add(2 * time.Minute); ; {
		r := tp.rec.next(t)
		perSide[r.Upstream]++
		if reached.IsZero() && perSide["stable"] >= 200 && perSide["canary"] >= 200 {
			reached = time.Now()
		}
		if g().Tripped != nil {
			if r.Upstream == "stable" {
				afterTrip++
			}
			if afterTrip >= 40 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not stopped in 2 minutes: sides %v, %d looks", perSide, g().Looks)
		}
	}
	close(stop)
	wg.Wait()
	st := g().Tripped
	if n := max(st.Values["candidate_requests"], st.Values["baseline_requests"]); n > 4*200 || !strings.Contains(st.Reason, "p95") {
		t.Fatalf("tripped with %v candidate and %v baseline requests (look %v): %s", st.Values["candidate_requests"], st.Values["baseline_requests"], st.Values["look"], st.Reason)
	}
	t.Logf("stopped at look %v, %v after both sides had 200 requests, with %v and %v: %s", st.Values["look"], st.At.Sub(reached).Round(100*time.Millisecond),
		st.Values["candidate_requests"], st.Values["baseline_requests"], st.Reason)
	// Once tripped, the canary takes nothing new (records of requests
	// sent before may still come: only these requests' are weighed).
	for i := range 20 {
		chat(t, tp.url, "X-Request-Id", fmt.Sprintf("after-trip-%d", i))
	}
	for seen := 0; seen < 20; {
		r := tp.rec.next(t)
		if !strings.HasPrefix(r.RequestID, "after-trip-") {
			continue
		}
		seen++
		if r.Upstream != "stable" {
			t.Fatalf("request %s went to %s after the guard tripped", r.RequestID, r.Upstream)
		}
	}
}
