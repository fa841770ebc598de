package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"math"
	"math/rand/v2"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	pmeasure "github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

func TestDistPercentiles(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	s := newDist(d)
	if s.N != 100 || s.P50 != 50 || s.P95 != 95 || s.P99 != 99 || s.Max != 100 || s.Mean != 50.5 {
		t.Fatalf("%+v", s)
	}
	if newDist(nil).N != 0 {
		t.Fatal("empty")
	}
}

// Gamma gaps keep the mean 1/rate whatever the burstiness; a smaller shape
// spreads them more.
func TestGammaArrivals(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, shape := range []float64{0.25, 1, 4} {
		var sum, sq float64
		const n = 200000
		for range n {
			x := gamma(r, shape) / shape
			sum += x
			sq += x * x
		}
		mean := sum / n
		cv2 := (sq/n - mean*mean) / (mean * mean)
		if math.Abs(mean-1) > 0.02 || math.Abs(cv2-1/shape) > 0.1/shape+0.05 {
			t.Errorf("shape %v: mean %.3f, squared CV %.3f, want 1 and %.3f", shape, mean, cv2, 1/shape)
		}
	}
}

func TestParseFlags(t *testing.T) {
	st, err := parseSteps("5:10s,50:2s")
	if err != nil || len(st) != 2 || st[1].Rate != 50 || st[1].For != 2*time.Second {
		t.Fatalf("%v %v", st, err)
	}
	if _, err := parseSteps("5"); err == nil {
		t.Fatal("bad step accepted")
	}
	o, err := parseSLO("ttft=500ms,tpot=50ms,e2e=10s")
	if err != nil || o.TTFT != 500*time.Millisecond || o.TPOT != 50*time.Millisecond || o.E2E != 10*time.Second {
		t.Fatalf("%+v %v", o, err)
	}
	if _, err := parseSLO("latency=1s"); err == nil {
		t.Fatal("unknown target accepted")
	}
	ok := result{Status: 200, TTFT: 100 * time.Millisecond, E2E: 500 * time.Millisecond, Output: 10} // TPOT 44 ms
	if !o.met(&ok) {
		t.Fatal("within SLO")
	}
	ok.TTFT = 600 * time.Millisecond
	if o.met(&ok) {
		t.Fatal("TTFT over the SLO met it")
	}
}

// The client against the simulated backend: streamed and not, closed and
// open loop; what it measures matches the backend's schedule.
func TestClientAgainstMock(t *testing.T) {
	s := httptest.NewServer(mockllm.New(mockllm.Options{PrefillBase: 30 * time.Millisecond, TokenGap: 10 * time.Millisecond, Jitter: 0.01, Stamp: true}))
	defer s.Close()
	p := plan{URL: s.URL + "/v1/chat/completions", Model: "m", Workloads: []workload{{Name: "t", PromptBytes: 100, MaxTokens: 5}},
		Stream: true, Stamped: true, Concurrency: 2, Requests: 6, Warmup: 1}
	res, wall, err := run(p)
	if err != nil || len(res) < 6 || wall <= 0 {
		t.Fatalf("%d results, %v", len(res), err)
	}
	sum := summarize("x", res, wall, 1, slo{TTFT: time.Second})
	if sum.Errors != 0 || sum.TTFT.P50 < 30 || sum.TTFT.P50 > 150 || sum.ITL.P50 < 9 || sum.ITL.P50 > 30 || sum.Delay.N == 0 || sum.GoodFraction != 1 {
		t.Fatalf("%+v", sum)
	}
	earlier := 0
	for _, r := range res {
		if r.Output != 5 || len(r.Tokens) != 5 || r.Input == 0 {
			t.Fatalf("result %+v", r)
		}
		// The kernel received the bytes before the client read them.
		if r.TTFTKernel <= 0 || r.TTFTKernel > r.TTFT || r.E2EKernel < r.TTFTKernel || r.E2EKernel > r.E2E {
			t.Fatalf("kernel times TTFT %v E2E %v against the reads' %v %v", r.TTFTKernel, r.E2EKernel, r.TTFT, r.E2E)
		}
		if r.TTFTKernel < r.TTFT {
			earlier++
		}
	}
	if earlier == 0 {
		t.Fatal("no first token carried a kernel receive time")
	}
	p.Stream, p.Rate, p.Requests, p.Duration = false, 50, 10, time.Second
	res, _, err = run(p)
	if err != nil || len(res) == 0 || res[0].Output != 5 || res[0].TTFT != -1 || res[0].Status != 200 {
		t.Fatalf("open loop, unstreamed: %+v %v", res, err)
	}
}

func TestCompareAccessLog(t *testing.T) {
	dir := t.TempDir()
	log := filepath.Join(dir, "a.log")
	os.WriteFile(log, []byte(`{"request_id":"p-1","ttft_ms":10.5,"e2e_ms":100,"itl_mean_ms":5,"qoe":0.9,"fluidity":1,"stall_ms":12,"stalls":0}`+"\n"+`{"request_id":"other"}`+"\n"), 0o644)
	res := []result{{ID: "p-1", TTFT: 10 * time.Millisecond, E2E: 101 * time.Millisecond, Tokens: []time.Duration{0, 5 * time.Millisecond, 11 * time.Millisecond},
		TTFTKernel: 10200 * time.Microsecond, E2EKernel: 100400 * time.Microsecond}}
	acc, err := compareLog(log, "p-", res, pmeasure.Pace{})
	if err != nil || acc.Matched != 1 || acc.TTFT.P50 != 0.5 || acc.E2E.P50 != 1 || acc.ITL.P50 != 0.5 ||
		acc.TTFTClientLonger != 0 || acc.E2EClientLonger != 1 ||
		math.Abs(acc.TTFTKernel.P50-0.3) > 1e-9 || math.Abs(acc.E2EKernel.P50-0.4) > 1e-9 || acc.TTFTKernelClientLonger != 0 || acc.E2EKernelClientLonger != 1 {
		t.Fatalf("%+v %v", acc, err)
	}
	// Read at the default pace the client's three tokens (0, 5, 11 ms)
	// never wait: qoe 1, fluidity 1, no stall; the log said 0.9 and 12 ms.
	if r := acc.Reading; r == nil || r.Streams != 1 || math.Abs(r.QoE.P50-0.1) > 1e-9 || r.Fluidity.P99 != 0 || r.Stall.P50 != 12 || r.StallsAgree != 1 {
		t.Fatalf("reading accuracy %+v", acc.Reading)
	}
}

// TestRunSummaryReadsStreams: a run's summary says how its streams read
// on the client's clock, at the SLO's pace.
func TestRunSummaryReadsStreams(t *testing.T) {
	ms := func(v int) time.Duration { return time.Duration(v) * time.Millisecond }
	res := []result{
		{ID: "a", Status: 200, TTFT: ms(100), E2E: ms(300), Tokens: []time.Duration{ms(100), ms(150), ms(200), ms(250), ms(300)}},
		// A 600 ms pause after the second token: one stall of 550 ms, the
		// reader done at 800 ms against 500 + 3·50: qoe 650/800.
		{ID: "b", Status: 200, TTFT: ms(100), E2E: ms(800), Tokens: []time.Duration{ms(100), ms(150), ms(750), ms(800)}},
		{ID: "c", Status: 200, Output: 3, E2E: ms(50)}, // whole: not read
	}
	s := summarize("run", res, time.Second, 0, slo{TTFT: 500 * time.Millisecond, TPOT: 50 * time.Millisecond})
	rd := s.Reading
	if rd == nil || rd.Streams != 2 || rd.StallRate != 0.5 || rd.StallMS.Max != 550 || rd.QoE.P99 != 650.0/800 || rd.QoE.Mean != (1+650.0/800)/2 {
		t.Fatalf("reading %+v", rd)
	}
}

func TestCompareResults(t *testing.T) {
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.json"), filepath.Join(dir, "b.json")
	writeJSON(a, map[string]any{"conditions": []summary{{Name: "chat/fresh/low", TTFT: dist{P50: 100}, RequestsPerS: 10}}})
	writeJSON(b, map[string]any{"conditions": []summary{{Name: "chat/fresh/low", TTFT: dist{P50: 110}, RequestsPerS: 10.3}}})
	var out strings.Builder
	if err := runCompare([]string{a, b}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "+10.0%") || !strings.Contains(out.String(), "+3.0%") {
		t.Fatalf("%s", out.String())
	}
}

// TestCompareIntervals: two result files whose TTFT differs by 10% (800
// requests each, with their samples) compare with an interval that
// excludes 0 for TTFT p50, and E2E (equal) within noise.
func TestCompareIntervals(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	file := func(scale float64) string {
		s := summary{Name: "run", Requests: 800, Samples: &samples{}}
		for range 800 {
			v := math.Exp(rng.NormFloat64()*0.3+math.Log(200)) * scale
			s.Samples.TTFT = append(s.Samples.TTFT, v)
			s.Samples.E2E = append(s.Samples.E2E, math.Exp(rng.NormFloat64()*0.3+math.Log(2000)))
		}
		s.TTFT.P50, s.E2E.P50 = median(s.Samples.TTFT), median(s.Samples.E2E)
		p := filepath.Join(t.TempDir(), "r.json")
		b, _ := json.Marshal(map[string]any{"summary": s})
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	var out strings.Builder
	if err := runCompare([]string{file(1), file(1.1)}, &out); err != nil {
		t.Fatal(err)
	}
	var ttft, e2e string
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.Contains(line, "TTFT p50") {
			ttft = line
		}
		if strings.Contains(line, "E2E p50") {
			e2e = line
		}
	}
	if !strings.Contains(ttft, "outside the noise") || !strings.Contains(e2e, "within noise") {
		t.Errorf("compare printed:\n%s", out.String())
	}
}

// The fasthttp relay streams: tokens reach the client as the backend
// sends them (not at the end), and fixed-length answers come whole, on
// kept-alive connections.
func TestFastRelayStreams(t *testing.T) {
	up := httptest.NewServer(mockllm.New(mockllm.Options{TokenGap: 20 * time.Millisecond, Jitter: 0.01}))
	defer up.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := fastRelay(strings.TrimPrefix(up.URL, "http://"))
	go s.Serve(ln)
	defer s.Shutdown()
	p := plan{URL: "http://" + ln.Addr().String() + "/v1/chat/completions", Model: "m",
		Workloads: []workload{{Name: "t", PromptBytes: 100, MaxTokens: 6}}, Stream: true, Concurrency: 2, Requests: 4}
	res, _, err := run(p)
	if err != nil || len(res) != 4 {
		t.Fatalf("%d results, %v", len(res), err)
	}
	for _, r := range res {
		// Six tokens 20 ms apart: the first comes about 100 ms before the end.
		if r.Status != 200 || r.Output != 6 || len(r.Tokens) != 6 || r.E2E-r.TTFT < 80*time.Millisecond {
			t.Fatalf("streamed: status %d, %d tokens, TTFT %v, E2E %v", r.Status, r.Output, r.TTFT, r.E2E)
		}
	}
	p.Stream = false
	if res, _, err = run(p); err != nil || len(res) != 4 || res[0].Status != 200 || res[0].Output != 6 {
		t.Fatalf("unstreamed: %+v %v", res, err)
	}
}

// The client speaks https://: against a TLS server it measures as over a
// plain one.
func TestClientOverTLS(t *testing.T) {
	s := httptest.NewTLSServer(mockllm.New(mockllm.Options{PrefillBase: 20 * time.Millisecond, TokenGap: 5 * time.Millisecond, Jitter: 0.01}))
	defer s.Close()
	pool := x509.NewCertPool()
	pool.AddCert(s.Certificate())
	p := plan{URL: s.URL + "/v1/chat/completions", TLS: &tls.Config{RootCAs: pool}, Model: "m",
		Workloads: []workload{{Name: "t", PromptBytes: 100, MaxTokens: 5}}, Stream: true, Stamped: true, Concurrency: 2, Requests: 6, Warmup: 1}
	res, _, err := run(p)
	if err != nil || len(res) < 6 {
		t.Fatalf("%d results, %v", len(res), err)
	}
	for _, r := range res {
		if r.Status != 200 || r.Output != 5 || len(r.Tokens) != 5 || r.TTFT < 20*time.Millisecond {
			t.Fatalf("result %+v", r)
		}
	}
	p.TLS = nil // the system's roots do not know the test's CA
	if res, _, err := run(p); err == nil && len(res) > 0 && res[0].Err == "" {
		t.Fatalf("an unknown CA was trusted: %+v", res[0])
	}
}
