package main

import (
	"bufio"
	"encoding/json"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// TestFrontierOf: the frontier is the last rate before the first that
// broke the limit or was not held, and is capped at direct's ceiling.
func TestFrontierOf(t *testing.T) {
	pts := []ratePoint{
		{Offered: 100, Added: 0.3, Held: true},
		{Offered: 200, Added: 0.8, Held: true},
		{Offered: 400, Added: 1.6, Held: true}, // one rate past 1 ms, then back: noise
		{Offered: 800, Added: 0.9, Held: true},
		{Offered: 1600, Added: 4, Held: false},
	}
	for _, c := range []struct {
		limit, cap, want float64
		capped           bool
	}{
		{1, 1e9, 800, false},
		{5, 1e9, 800, false},   // 1600 was not held, and the arm stopped there
		{5, 400, 400, true},    // direct held no more than 400
		{0.1, 1e9, 0, false},   // two rates in a row past the limit from the start
		{10, 50, 0, true},      // direct's ceiling under every rate tried
		{1, 200, 200, true},    // frontier and direct's ceiling meet
		{1.6, 1e9, 800, false}, // a limit met exactly passes
	} {
		got, capped := frontierOf(pts, c.limit, c.cap)
		if got != c.want || capped != c.capped {
			t.Errorf("limit %v cap %v: %v capped=%v, want %v capped=%v", c.limit, c.cap, got, capped, c.want, c.capped)
		}
	}
	two := []ratePoint{{Offered: 100, Added: 0.3, Held: true}, {Offered: 200, Added: 1.2, Held: true}, {Offered: 400, Added: 1.5, Held: true}, {Offered: 800, Added: 0.5, Held: true}}
	if got, capped := frontierOf(two, 1, 1e9); got != 100 || capped {
		t.Errorf("two rates in a row past the limit: %v capped=%v, want 100", got, capped)
	}
	// Two rates where the A/A control itself was past 5 ms (a machine
	// stall over all arms) decide nothing at 5 ms; at 10 ms they count.
	noisy := []ratePoint{{Offered: 100, Added: 0.3, Held: true}, {Offered: 200, Added: 12, Band: 6, Held: true},
		{Offered: 300, Added: 12, Band: 6, Held: true}, {Offered: 400, Added: 0.4, Held: true}}
	if got, _ := frontierOf(noisy, 5, 1e9); got != 400 {
		t.Errorf("rates the control could not judge: frontier %v, want 400", got)
	}
	if got, _ := frontierOf(noisy, 10, 1e9); got != 100 {
		t.Errorf("at 10 ms: frontier %v, want 100 (two rates in a row past it)", got)
	}
}

// TestFrontierSimulated: sweeps of an arm whose true added p99 is known,
// measured with the noise of two p99s (larger at low rates, where a p99
// rests on few requests). The frontier found lands within one rate step
// of the truth in most sweeps and rarely above it, at small and large
// limits; the rule of two rates in a row stops early no more often than
// stopping at the first rate past the limit would.
func TestFrontierSimulated(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	f := frontierSettings{minRate: 100, maxRate: 40000, factor: 1.25}
	rates := f.rates()
	for _, c := range []struct {
		limit, truth float64 // the rate at which the true added p99 reaches limit
	}{{1, 600}, {1, 5000}, {5, 3000}, {10, 20000}} {
		trueAdded := func(rate float64) float64 { return 0.2*c.limit + 0.8*c.limit*math.Pow(rate/c.truth, 3) }
		var truthRate float64
		for _, x := range rates {
			if trueAdded(x) <= c.limit {
				truthRate = x
			}
		}
		const n = 2000
		early, above, earlyFirst := 0, 0, 0
		for range n {
			var pts []ratePoint
			for _, x := range rates {
				// The difference of two p99s: Gaussian scatter that
				// shrinks with the requests beyond the p99 in a probe
				// (1.5 s, at least minProbeRequests), and now and then a stall of the load generator
				// or the backend in one of the two (heavy-tailed).
				tail := max(x*1.5, minProbeRequests) * 0.01
				a := trueAdded(x) + 0.5/math.Sqrt(max(tail, 0.25)/2)*r.NormFloat64()
				if r.Float64() < 0.05 {
					a += 2 * r.ExpFloat64()
				}
				pts = append(pts, ratePoint{Offered: x, Added: a, Held: true})
				if trueAdded(x) > 3*c.limit {
					break // the arm has fallen far behind: the sweep stops it
				}
			}
			got, _ := frontierOf(pts, c.limit, 1e9)
			if got < truthRate/f.factor/1.01 {
				early++
			}
			if got > truthRate*f.factor*1.01 {
				above++
			}
			first := 0.0
			for _, p := range pts {
				if p.Added > c.limit {
					break
				}
				first = p.Offered
			}
			if first < truthRate/f.factor/1.01 {
				earlyFirst++
			}
		}
		t.Logf("limit %v ms, true frontier %v/s: more than a step early %d, more than a step above %d of %d (first-failure rule: early %d)", c.limit, truthRate, early, above, n, earlyFirst)
		if early > n/8 || above > n/10 || early > earlyFirst {
			t.Errorf("limit %v ms, true frontier %v/s: more than a step early in %d, above in %d of %d sweeps (first-failure rule: early in %d)", c.limit, truthRate, early, above, n, earlyFirst)
		}
	}
}

// TestHeldArrivals: an arm that keeps up answers as many requests as
// arrived in the window, a Poisson count or, with bursts (gamma gaps of
// shape 0.25), a more spread one; held must pass nearly all such windows at
// small and large n, and fail an arm that answers 10% fewer at large n.
func TestHeldArrivals(t *testing.T) {
	wait.Long(t, "held arrivals at the bench's rates")
	r := rand.New(rand.NewPCG(1, 2))
	// count is how many arrivals with gamma gaps of shape (mean gap 1/shape
	// units, as the load generator makes them) fall within mean units.
	count := func(shape, mean float64) int {
		n, at := 0, 0.0
		for {
			at += gamma(r, shape) / shape
			if at > mean {
				return n
			}
			n++
		}
	}
	for _, c := range []struct {
		rate, shape float64
		d           time.Duration
	}{
		{100, 1, 300 * time.Millisecond}, {100, 1, time.Second}, {5000, 1, time.Second}, {20000, 1, 1500 * time.Millisecond},
		{100, 0.25, time.Second}, {5000, 0.25, time.Second}, {20000, 0.25, 1500 * time.Millisecond},
	} {
		mean := c.rate * c.d.Seconds()
		fails := 0
		for range 2000 {
			if !held(c.rate, c.d, c.shape, count(c.shape, mean), 0) {
				fails++
			}
		}
		if fails > 10 { // three sigma: about 0.1% one-sided, plus the discrete edge
			t.Errorf("rate %v, shape %v, over %v: %d of 2000 windows of an arm that kept up were judged behind", c.rate, c.shape, c.d, fails)
		}
		if mean >= 1000/c.shape && held(c.rate, c.d, c.shape, int(0.9*mean), 0) {
			t.Errorf("rate %v, shape %v, over %v: 90%% of the arrivals answered was judged held", c.rate, c.shape, c.d)
		}
	}
	if held(1000, time.Second, 1, 1000, 2) {
		t.Error("0.2% errors judged held")
	}
	if !held(1000, time.Second, 1, 1000, 1) {
		t.Error("0.1% errors judged not held")
	}
}

// TestJudgeStreams: a lost frame, an error, a stall or too few streams
// fail a level; whole streams within the stall bound pass.
func TestJudgeStreams(t *testing.T) {
	stream := func(gaps ...time.Duration) result {
		r := result{Status: 200}
		at := time.Duration(0)
		for _, g := range gaps {
			at += g
			r.Tokens = append(r.Tokens, at)
		}
		return r
	}
	ms50 := 50 * time.Millisecond
	ok := []result{stream(ms50, ms50, ms50), stream(ms50, 400*time.Millisecond, ms50)}
	if c := judgeStreams(2, ok, 3, 500*time.Millisecond); !c.OK || c.MaxGapMs != 400 {
		t.Errorf("whole streams: %+v", c)
	}
	for name, res := range map[string][]result{
		"stall":  {stream(ms50, 600*time.Millisecond, ms50), stream(ms50, ms50, ms50)},
		"short":  {stream(ms50, ms50), stream(ms50, ms50, ms50)},
		"error":  {{Err: "EOF"}, stream(ms50, ms50, ms50)},
		"status": {{Status: 502}, stream(ms50, ms50, ms50)},
		"few":    {stream(ms50, ms50, ms50)},
	} {
		if c := judgeStreams(2, res, 3, 500*time.Millisecond); c.OK {
			t.Errorf("%s: judged ok: %+v", name, c)
		}
	}
	if got := ceilingOf([]ceilPoint{{Streams: 256, OK: true}, {Streams: 512, OK: true}, {Streams: 1024}, {Streams: 2048, OK: true}}); got != 512 {
		t.Errorf("ceiling %d, want 512", got)
	}
}

// TestFrontierReport: a report of two rounds with known figures derives
// the keys results.json promises, medians and ratios included, and
// renders and re-renders from results.json alike.
func TestFrontierReport(t *testing.T) {
	sweep := func(added ...float64) []ratePoint {
		var out []ratePoint
		for i, a := range added {
			out = append(out, ratePoint{Offered: 100 * math.Pow(2, float64(i)), Added: a, Held: true, P99: 21 + a})
		}
		return out
	}
	round := func(k float64) frontierRound {
		return frontierRound{
			OneClient: map[string]roundStat{"direct": {E2Ep99: 21}, "tokentap": {E2Ep99: 21.2 * k}, "nginx": {E2Ep99: 21.1}},
			Sweep:     map[string][]ratePoint{"direct": sweep(0, 0, 0, 0), "tokentap": sweep(0.5, 2, 6, 20), "nginx": sweep(0.2, 0.4, 3, 8)},
			DirectCap: 800,
			Ceiling: map[string][]ceilPoint{"direct": {{Streams: 256, OK: true}, {Streams: 512, OK: true}},
				"tokentap": {{Streams: 256, OK: true}, {Streams: 512}}, "nginx": {{Streams: 256, OK: true}, {Streams: 512, OK: true}}},
			Streams: map[string]roundStat{"direct": {Requests: 10, TTFTp99: 2}, "tokentap": {Requests: 10, TTFTp99: 3}, "nginx": {Requests: 10, TTFTp99: 2.5}},
			CPU:     map[string]roundStat{"tokentap": {Requests: 1000, CPU: 0.03 * k}, "nginx": {Requests: 1000, CPU: 0.02}},
		}
	}
	rep := &frontierReport{Machine: map[string]string{"cpu": "x", "cores": "2", "kernel": "k"},
		Settings: map[string]any{"gomaxprocs": 1, "limits_ms": []float64{1, 5, 10}, "backend_ms": 20.0, "tokens_per_stream": 16, "pace_ms": 50.0},
		Arms:     []string{"direct", "tokentap", "nginx"}, Rounds: []frontierRound{round(1), round(1.5)},
		IdleRSS: map[string]float64{"tokentap": 30, "nginx": 15}, Tried: gatewaysTried()}
	dir := t.TempDir()
	var out strings.Builder
	if err := writeFrontier(dir, rep, &out); err != nil {
		t.Fatal(err)
	}
	d := rep.Derived
	want := map[string]float64{
		"frontier_rps_p99_1ms/tokentap": 100, "frontier_rps_p99_5ms/tokentap": 200, "frontier_rps_p99_10ms/tokentap": 400,
		"frontier_rps_p99_1ms/nginx": 200, "frontier_rps_p99_5ms/nginx": 400, "frontier_rps_p99_10ms/nginx": 800,
		"frontier_rps_p99_10ms/direct": 800, "stream_ceiling/tokentap": 256, "stream_ceiling/nginx": 512,
		"added_ttft_p99_ms_512/tokentap": 1, "idle_rss_mb_per_1000/nginx": 15,
		"cpu_us_per_request/tokentap": 37.5, "cpu_us_per_request/nginx": 20,
	}
	for k, v := range want {
		if got := get(d, k).Median; math.Abs(got-v) > 1e-9 {
			t.Errorf("%s = %v, want %v", k, got, v)
		}
	}
	if got := get(d, "added_p99_ms_c1/tokentap"); math.Abs(got.Median-5.5) > 1e-9 || math.Abs(got.Max-10.8) > 1e-9 {
		t.Errorf("added_p99_ms_c1/tokentap = %+v, want median 5.5, max 10.8", got)
	}
	if n, _ := d["frontier_capped_rounds_p99_10ms/nginx"].(int); n != 2 {
		t.Errorf("nginx held up to direct's ceiling in both rounds: capped %v", d["frontier_capped_rounds_p99_10ms/nginx"])
	}
	md := out.String()
	for _, s := range []string{"| tokentap | 400 |", "| nginx | ≥ 800 |", "0.50×", "Stream ceiling"} {
		if !strings.Contains(md, s) {
			t.Errorf("results.md lacks %q:\n%s", s, md)
		}
	}
	var back map[string]any
	b, _ := os.ReadFile(filepath.Join(dir, "results.json"))
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if m, ok := back["derived"].(map[string]any)["frontier_rps_p99_5ms/tokentap"].(map[string]any); !ok || m["median"] != 200.0 {
		t.Errorf("results.json derived frontier_rps_p99_5ms/tokentap: %v", back["derived"].(map[string]any)["frontier_rps_p99_5ms/tokentap"])
	}
	svg, _ := os.ReadFile(filepath.Join(dir, "frontier.svg"))
	if strings.Count(string(svg), "<polyline") != 2 {
		t.Errorf("the plot has %d lines, want one per arm but direct", strings.Count(string(svg), "<polyline"))
	}
	var again strings.Builder
	if err := rerenderFrontier(dir, &again); err != nil {
		t.Fatal(err)
	}
	if again.String() != md {
		t.Errorf("re-rendered from results.json differs:\n%s\nwant\n%s", again.String(), md)
	}
}

// TestClientStalePooledConnection: a server that closes a keep-alive
// connection while it sits idle (nginx's keepalive_timeout). The next
// request on the pooled connection fails before any response byte and is
// sent again on a new connection; a server that breaks a request it did
// answer in part is not retried.
func TestClientStalePooledConnection(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n := conns.Add(1)
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for i := 0; ; i++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					if n == 3 && i == 1 { // half an answer, then gone
						io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\"")
						return
					}
					io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
					if n < 3 {
						return // closed while idle
					}
				}
			}()
		}
	}()
	cl, err := newClient("http://"+ln.Addr().String()+"/v1/chat/completions", nil, 5*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.closeIdle()
	if r := cl.do("a", []byte(`{}`), false); r.Err != "" || r.Status != 200 {
		t.Fatalf("first request: %+v", r)
	}
	time.Sleep(50 * time.Millisecond) // the server has closed the pooled connection
	if r := cl.do("b", []byte(`{}`), false); r.Err != "" || r.Status != 200 {
		t.Fatalf("the request after the server closed the idle connection: %+v", r)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the stale one, then a new one)", n)
	}
	time.Sleep(50 * time.Millisecond)
	cl.closeIdle()
	if r := cl.do("c", []byte(`{}`), false); r.Err != "" {
		t.Fatalf("third connection: %+v", r)
	}
	if r := cl.do("d", []byte(`{}`), false); r.Err == "" {
		t.Fatalf("a response cut short passed: %+v", r)
	}
	if n := conns.Load(); n != 3 {
		t.Fatalf("%d connections, want 3: a request answered in part is not sent again", n)
	}
}

// A round whose CPU could not be read (0 s: the kernel's scheduler
// statistics were off and the ticks had not moved) is left out of the CPU
// figure, not counted as free.
func TestFrontierCPUUnreadRoundLeftOut(t *testing.T) {
	rep := &frontierReport{Arms: []string{"direct", "tokentap"}}
	for _, cpu := range []float64{0, 0.12, 0.15} {
		rep.Rounds = append(rep.Rounds, frontierRound{CPU: map[string]roundStat{"tokentap": {Requests: 1000, CPU: cpu}}})
	}
	got := deriveFrontier(rep)["cpu_us_per_request/tokentap"].(spread)
	if math.Abs(got.Min-120) > 1e-9 || math.Abs(got.Max-150) > 1e-9 || math.Abs(got.Median-135) > 1e-9 {
		t.Fatalf("CPU per request %+v, want median 135 over 120–150 µs (the unread round left out)", got)
	}
}

// TestFrontierProbesOutvoteStalls: the sweep's rule on simulated probes
// whose truth is known. Each probe's added p99 is the true one, Gaussian
// scatter, and now and then (10% of probes, either side) a stall of the
// machine of 5 to 30 ms, as the rounds saw: in the arm's p99 it
// adds, in direct's it takes away. With one probe a rate, such a stall
// decides the 5 ms frontier of a sweep, more than a step early, in a tenth
// of runs or more; with the median of three probes (and the A/A control's
// band), the frontier is within a step of the truth in at least 95% of
// sweeps, and found more than a step above it no more often than one
// probe finds it.
func TestFrontierProbesOutvoteStalls(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	f := frontierSettings{minRate: 100, maxRate: 40000, factor: 1.25}
	rates := f.rates()
	const limit, truth = 5.0, 3000.0
	trueAdded := func(rate float64) float64 { return 0.5 + 4.5*math.Pow(rate/truth, 3) }
	truthRate := 0.0
	for _, x := range rates {
		if trueAdded(x) <= limit {
			truthRate = x
		}
	}
	stall := func() float64 {
		if r.Float64() < 0.1 {
			return 5 + 25*r.Float64()
		}
		return 0
	}
	probe := func(added float64) float64 { return added + 0.3*r.NormFloat64() + stall() - stall() }
	sweepWith := func(probes int) float64 {
		var pts []ratePoint
		for _, x := range rates {
			var ps, control []ratePoint
			for range probes {
				ps = append(ps, ratePoint{Offered: x, Added: probe(trueAdded(x)), Held: true})
				control = append(control, ratePoint{Offered: x, Added: probe(0), Held: true})
			}
			p := mergeProbes(ps)
			if probes > 1 {
				p.Band = math.Abs(median(addedOf(control)))
			}
			pts = append(pts, p)
			if trueAdded(x) > 3*limit {
				break
			}
		}
		got, _ := frontierOf(pts, limit, 1e9)
		return got
	}
	const n = 2000
	var early, above [2]int
	for range n {
		for i, probes := range []int{1, 3} {
			got := sweepWith(probes)
			if got < truthRate/f.factor/1.01 {
				early[i]++
			}
			if got > truthRate*f.factor*1.01 {
				above[i]++
			}
		}
	}
	t.Logf("true frontier %v/s; more than a step early: one probe %d, three %d of %d; above: %d, %d", truthRate, early[0], early[1], n, above[0], above[1])
	if early[0] < n/10 || early[1]+above[1] > n/20 || above[1] > above[0] {
		t.Errorf("more than a step early: one probe %d, three %d of %d; above: %d, %d", early[0], early[1], n, above[0], above[1])
	}
}

// mergeProbes takes the medians and keeps every probe; a point is held
// when most of its probes were.
func TestMergeProbes(t *testing.T) {
	p := mergeProbes([]ratePoint{
		{Offered: 300, P99: 25, Added: 1, Held: true, Requests: 400},
		{Offered: 300, P99: 50, Added: 26, Held: false, Requests: 380},
		{Offered: 300, P99: 24, Added: 0.5, Held: true, Requests: 410},
	})
	if p.Offered != 300 || p.P99 != 25 || p.Added != 1 || !p.Held || p.Requests != 400 || len(p.Probes) != 3 || p.Probes[1] != 26 {
		t.Errorf("%+v", p)
	}
	if q := mergeProbes([]ratePoint{{Held: true}, {Held: false}}); q.Held {
		t.Error("held in one probe of two counts as held")
	}
}
