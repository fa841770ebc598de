package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"go.uber.org/zap/zapcore"
)

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) Sync() error { return nil }
func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// promValue returns the value of one exposed series, given as its name with
// labels exactly as exposed (0 when absent).
func promValue(t *testing.T, series string) int {
	t.Helper()
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, line := range strings.Split(b.String(), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return 0
}

// requestsTotal sums tokentap_requests_total over the series whose labels
// contain every given fragment.
func requestsTotal(t *testing.T, fragments ...string) int {
	t.Helper()
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	total := 0
	for _, line := range strings.Split(b.String(), "\n") {
		if !strings.HasPrefix(line, "tokentap_requests_total{") {
			continue
		}
		ok := true
		for _, f := range fragments {
			ok = ok && strings.Contains(line, f)
		}
		if ok {
			n, _ := strconv.Atoi(line[strings.LastIndexByte(line, ' ')+1:])
			total += n
		}
	}
	return total
}

// Every request, whatever its fate, gets exactly one access log line and
// one count in tokentap_requests_total; secrets never reach the log.
func TestOneLogLineAndOneCountPerRequest(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/v1/chat/completions":
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, chatChunk("a")+chatChunk("b")+"data: [DONE]\n\n")
		case "/boom":
			http.Error(w, "boom", 500)
		case "/slow":
			time.Sleep(2 * time.Second)
		default:
			io.WriteString(w, `{"usage":{"prompt_tokens":1,"completion_tokens":2}}`)
		}
	})
	deadURL := "http://" + deadAddr(t)

	logBuf := &syncBuffer{}
	alog := metrics.NewAccessLog(zapcore.AddSync(logBuf), 0)
	defer alog.Close()
	cfg := Config{
		Routes: []Route{
			{Name: "chat", Prefix: "/v1/", Upstream: up.URL, Timeouts: DefaultTimeouts},
			{Name: "misc", Prefix: "/boom", Upstream: up.URL, Timeouts: DefaultTimeouts},
			{Name: "slow", Prefix: "/slow", Upstream: up.URL, Timeouts: func() Timeouts { t := DefaultTimeouts; t.FirstByte = 50 * time.Millisecond; return t }()},
			{Name: "dead", Prefix: "/dead", Upstream: deadURL, Timeouts: DefaultTimeouts},
		},
		Models:        []string{"llama"},
		EnforceModels: false,
		// The allowlist alone: no model learned by name (TestModelsByName
		// tests the bounded learning).
		ModelsPerRoute: -1,
	}
	p, err := New(cfg, Options{Sinks: []metrics.Sink{alog}, MaxRequestBodySize: 1024})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ln, _ := p.Listen("127.0.0.1:0")
	go p.Serve(ln)
	defer p.Shutdown(context.Background())
	base := "http://" + ln.Addr().String()

	before := requestsTotal(t)
	// Series outlive a proxy (they survive reloads): count what this test adds.
	otherBefore := requestsTotal(t, `route="chat"`, `model="other"`, `outcome="ok"`, `status_class="2xx"`)
	llamaBefore := requestsTotal(t, `route="chat"`, `model="llama"`, `outcome="ok"`)
	ttftBefore := promValue(t, `tokentap_ttft_seconds_count{route="chat",model="llama"}`)
	const secret = "sk-very-secret-key"
	send := func(method, path, body string) int {
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+secret)
		req.Header.Set("x-api-key", secret)
		req.Header.Set("api-key", secret)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	cases := []struct {
		method, path, body string
		status             int
		outcome            metrics.Outcome
		route              string
	}{
		{"POST", "/v1/chat/completions", `{"model":"llama","stream":true}`, 200, metrics.OutcomeOK, "chat"},
		{"POST", "/v1/chat/completions", `{"model":"client-invented-model","stream":true}`, 200, metrics.OutcomeOK, "chat"},
		{"POST", "/v1/completions", `{"model":"llama"}`, 200, metrics.OutcomeOK, "chat"},
		{"GET", "/boom", ``, 500, metrics.OutcomeUpstreamError, "misc"},
		{"POST", "/slow", `{}`, 504, metrics.OutcomeUpstreamTimeout, "slow"},
		{"POST", "/dead", `{}`, 502, metrics.OutcomeUpstreamError, "dead"},
		{"GET", "/nowhere", ``, 404, metrics.OutcomeBadRequest, "unmatched"},
		{"POST", "/v1/chat/completions", strings.Repeat("x", 2000), 413, metrics.OutcomeBadRequest, "chat"},
	}
	for _, c := range cases {
		if got := send(c.method, c.path, c.body); got != c.status {
			t.Errorf("%s %s: status %d, want %d", c.method, c.path, got, c.status)
		}
	}
	// A record waits for the client's acknowledgement of its response's
	// last bytes, so lines can come in another order: wait for all, and
	// order them by request id (a counter).
	var lines []string
	waitFor(t, func() error {
		alog.Flush()
		if lines = strings.Split(strings.TrimSpace(logBuf.String()), "\n"); len(lines) < len(cases) {
			return fmt.Errorf("%d log lines for %d requests", len(lines), len(cases))
		}
		return nil
	})
	slices.SortFunc(lines, func(a, b string) int { return strings.Compare(jsonField(a, "request_id"), jsonField(b, "request_id")) })
	if len(lines) != len(cases) {
		t.Fatalf("%d log lines for %d requests:\n%s", len(lines), len(cases), logBuf.String())
	}
	if strings.Contains(logBuf.String(), secret) {
		t.Fatal("a secret reached the access log")
	}
	required := []string{"request_id", "route", "model", "tenant", "method", "path", "status", "outcome", "stream",
		"e2e_ms", "output_tokens", "input_tokens", "tokens_source", "events", "bytes_in", "bytes_out"}
	for i, line := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("line %d is not JSON: %v\n%s", i, err, line)
		}
		c := cases[i]
		if m["outcome"] != string(c.outcome) || m["status"] != float64(c.status) || m["route"] != c.route {
			t.Errorf("line %d: got outcome=%v status=%v route=%v, want %v %d %v", i, m["outcome"], m["status"], m["route"], c.outcome, c.status, c.route)
		}
		for _, k := range required {
			if _, ok := m[k]; !ok {
				t.Errorf("line %d lacks %s: %s", i, k, line)
			}
		}
		_, hasTTFT := m["ttft_ms"]
		_, hasITL := m["itl_p50_ms"]
		_, hasTTFB := m["upstream_ttfb_ms"]
		stream := i < 2
		if hasTTFT != stream || hasITL != stream {
			t.Errorf("line %d: ttft/itl present=%v/%v, want %v: %s", i, hasTTFT, hasITL, stream, line)
		}
		if wantTTFB := c.status < 400; hasTTFB != wantTTFB && c.status != 500 {
			t.Errorf("line %d: upstream_ttfb_ms present=%v: %s", i, hasTTFB, line)
		}
	}
	if got := requestsTotal(t) - before; got != len(cases) {
		t.Fatalf("tokentap_requests_total grew by %d, want %d", got, len(cases))
	}
	// With no model learned, label values come from the config only: the
	// invented model is "other".
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	if strings.Contains(b.String(), "client-invented-model") {
		t.Fatal("a client-supplied model name became a label value")
	}
	if n := requestsTotal(t, `route="chat"`, `model="other"`, `outcome="ok"`, `status_class="2xx"`) - otherBefore; n != 1 {
		t.Fatalf("chat/other/ok/2xx = %d, want 1", n)
	}
	if n := requestsTotal(t, `route="chat"`, `model="llama"`, `outcome="ok"`) - llamaBefore; n != 2 {
		t.Fatalf("chat/llama/ok = %d, want 2", n)
	}
	if promValue(t, `tokentap_ttft_seconds_count{route="chat",model="llama"}`)-ttftBefore != 1 {
		t.Fatal("ttft histogram not updated once for chat/llama")
	}
}

func TestModelAllowlistEnforced(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	tp := startProxy(t, up.URL, func(c *Config) { c.Models, c.EnforceModels = []string{"a"}, true })
	for model, want := range map[string]int{"a": 200, "b": 400} {
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"`+model+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("model %s: %d %s", model, resp.StatusCode, b)
		}
		rec := tp.rec.next(t)
		if want == 400 && (rec.Outcome != metrics.OutcomeBadRequest || !strings.Contains(string(b), "model_not_allowed") || rec.UpstreamTTFB != metrics.Absent) {
			t.Fatalf("record %+v body %s", rec, b)
		}
	}
}

func TestNDJSONStreamCounted(t *testing.T) {
	lines := `{"message":{"content":"a"},"done":false}` + "\n" + `{"message":{"content":"b"},"done":false}` + "\n" + `{"done":true}` + "\n"
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/x-ndjson")
		for _, l := range strings.SplitAfter(lines, "\n") {
			io.WriteString(w, l)
			flush(w)
			time.Sleep(5 * time.Millisecond)
		}
	})
	tp := startProxy(t, up.URL, nil)
	resp, err := http.Post(tp.url+"/custom/stream", "application/json", strings.NewReader(`{"model":"llama3"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != lines {
		t.Fatalf("body %q", b)
	}
	rec := tp.rec.next(t)
	if !rec.Stream || rec.Events != 3 || rec.TokensSource != "counted" || rec.Dialect != "generic" || rec.TTFT < 0 {
		t.Fatalf("record: %+v", rec)
	}
}

// jsonField returns a string field of a JSON line, or "".
func jsonField(line, name string) string {
	var m map[string]any
	_ = json.Unmarshal([]byte(line), &m)
	s, _ := m[name].(string)
	return s
}
