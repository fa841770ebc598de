package main

import (
	"math"
	"strings"
	"testing"
	"time"
)

// TestSummarizeKnownRun: a run whose every figure is known. 100 requests,
// request i answering its first token at i ms and then 9 more tokens 5 ms
// apart, with two errors (one a timeout) among them, over 10 s, against a
// first-token objective of 50 ms: the summary counts the errors apart,
// judges requests 0 to 50 good (49 of them, 2 having failed), and its
// percentiles, rates and samples are those of the served requests.
func TestSummarizeKnownRun(t *testing.T) {
	var res []result
	for i := range 100 {
		r := result{Status: 200, TTFT: time.Duration(i) * time.Millisecond, Output: 10}
		for k := range 10 {
			r.Tokens = append(r.Tokens, r.TTFT+time.Duration(k)*5*time.Millisecond)
		}
		r.E2E = r.Tokens[9]
		switch i {
		case 10:
			r.Err, r.Status = "reset", 0
		case 20:
			r.Err, r.Timeout = "timeout", true
		}
		res = append(res, r)
	}
	o, err := parseSLO("ttft=50ms")
	if err != nil {
		t.Fatal(err)
	}
	s := summarize("known", res, 10*time.Second, 0, o)
	if s.Requests != 100 || s.Errors != 2 || s.Timeouts != 1 {
		t.Fatalf("requests %d, errors %d, timeouts %d", s.Requests, s.Errors, s.Timeouts)
	}
	if s.GoodFraction != 0.49 || math.Abs(s.GoodputPerS-4.9) > 1e-9 || math.Abs(s.RequestsPerS-9.8) > 1e-9 || math.Abs(s.OutputTokPerS-98) > 1e-9 {
		t.Fatalf("good %.2f, goodput %.2f/s, %.2f requests/s, %.2f tokens/s", s.GoodFraction, s.GoodputPerS, s.RequestsPerS, s.OutputTokPerS)
	}
	// 98 first tokens, 0..99 ms without 10 and 20, by nearest rank: the
	// 49th is 50 ms, the 98th (ceil of 0.99 x 98) 99 ms.
	if s.TTFT.N != 98 || s.TTFT.P50 != 50 || s.TTFT.P99 != 99 || s.TTFT.Max != 99 {
		t.Fatalf("TTFT %+v", s.TTFT)
	}
	if s.ITL.N != 98*9 || s.ITL.P50 != 5 || s.ITL.Max != 5 || s.TPOT.P99 != 5 {
		t.Fatalf("ITL %+v, TPOT %+v", s.ITL, s.TPOT)
	}
	if len(s.Samples.TTFT) != 98 || len(s.Samples.ITLByRequest) != 98 || len(s.Samples.TokensPerS) != 98 {
		t.Fatalf("samples: %d TTFT, %d requests' gaps, %d tokens/s", len(s.Samples.TTFT), len(s.Samples.ITLByRequest), len(s.Samples.TokensPerS))
	}
	again := summarize("known", res, 10*time.Second, 0, o)
	for i := range s.Samples.TTFT {
		if s.Samples.TTFT[i] != again.Samples.TTFT[i] {
			t.Fatal("the same run kept other samples: the choice is seeded")
		}
	}
}

// TestSamplesBounded: a run longer than maxSamples keeps maxSamples of
// each figure, drawn from the whole run (its last quarter among them).
func TestSamplesBounded(t *testing.T) {
	res := make([]result, 2*maxSamples)
	for i := range res {
		res[i] = result{Status: 200, TTFT: time.Duration(i) * time.Microsecond, E2E: time.Millisecond, Output: 1}
	}
	s := summarize("long", res, time.Minute, 0, slo{})
	if len(s.Samples.TTFT) != maxSamples {
		t.Fatalf("%d TTFT samples, want %d", len(s.Samples.TTFT), maxSamples)
	}
	late := 0
	for _, v := range s.Samples.TTFT {
		if v >= float64(3*maxSamples/2)/1000 {
			late++
		}
	}
	if late < maxSamples/5 {
		t.Fatalf("%d of %d samples from the run's last quarter: not drawn from the whole run", late, maxSamples)
	}
}

// TestParseSLO: each target by name, several at once; a bad duration or
// an unknown name is an error naming it.
func TestParseSLO(t *testing.T) {
	o, err := parseSLO("ttft=500ms, tpot=50ms,e2e=10s")
	if err != nil || o.TTFT != 500*time.Millisecond || o.TPOT != 50*time.Millisecond || o.E2E != 10*time.Second {
		t.Fatalf("%+v, %v", o, err)
	}
	for _, bad := range []string{"ttft=fast", "ttft", "ttft=-1s", "itl=5ms"} {
		if _, err := parseSLO(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	slow := result{Status: 200, TTFT: 600 * time.Millisecond, E2E: time.Second, Output: 2}
	if o.met(&slow) {
		t.Error("a 600 ms first token met a 500 ms objective")
	}
}

// TestProxiesMarkdown: the side-by-side report's tables carry each arm's
// figures where they belong: the streams' medians and spreads, the added
// time against direct and its ratio to nginx's, requests per second
// against direct and nginx, bursts, idle memory and the accuracy rows.
func TestProxiesMarkdown(t *testing.T) {
	one := func(v float64) []roundStat {
		return []roundStat{{TTFTp50: v, TTFTp99: 2 * v, DelayP50: v / 10, DelayP99: v / 5}, {TTFTp50: v + 1, TTFTp99: 2*v + 1, DelayP50: v / 10, DelayP99: v / 5}}
	}
	arms := []*arm{{Name: "direct"}, {Name: "nginx", pids: func() []int { return nil }}, {Name: "tokentap", pids: func() []int { return nil }}}
	rep := &proxiesReport{
		Machine:   map[string]string{"cpu": "test cpu", "cores": "2", "kernel": "6.1"},
		Settings:  map[string]any{"tokentap_gomaxprocs": 1, "rounds": 2, "round_time_s": 1, "tokens_per_stream": 64, "token_gap_ms": 10, "burst_requests": 500, "burst_gap_s": 1},
		Streaming: map[string]map[string][]roundStat{"100": {"direct": one(10), "nginx": one(11), "tokentap": one(12)}},
		Bursts:    map[string][]roundStat{"nginx": {{}}},
		IdleRSS:   map[string]float64{"nginx": 3.5, "tokentap": 7.25},
		IdleCount: 5000,
		Accuracy:  &accuracy{Matched: 99},
		Derived: map[string]any{
			"added_ttft_p50_ms/100/tokentap": spread{Median: 2}, "added_ttft_p50_ms/100/nginx": spread{Median: 1},
			"small_requests_per_s/direct": spread{Median: 1000}, "small_requests_per_s/nginx": spread{Median: 800, Min: 790, Max: 810},
			"small_requests_per_s/tokentap": spread{Median: 400, Min: 390, Max: 410}, "cpu_us_per_small_request/tokentap": spread{Median: 118.4},
			"burst_e2e_p50_ms/tokentap": spread{Median: 5}, "burst_e2e_p50_ms/nginx": spread{Median: 4},
		},
	}
	md := markdown(rep, arms, []int{100})
	for _, want := range []string{
		"Machine: test cpu, 2 cores, 6.1.",
		"### 100 concurrent streams (64 tokens each, 10ms apart)",
		"| direct | 10.500 [10.000–11.000] | 20.500 [20.000–21.000] |",
		"| tokentap | 12.500 [12.000–13.000] |",
		"| +2.000 |",
		"| 400 [390–410] | 0.40× | 0.50× | 118.4 |",
		"| nginx | 800 [790–810] | 0.80× | 1.00× |",
		"### Bursts: 500 small requests at once after 1s quiet",
		"### Memory: 5000 idle streams open at once",
		"| tokentap | 7.2 MB |",
		"(99 requests matched by id)",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("the report lacks %q:\n%s", want, md)
		}
	}
}
