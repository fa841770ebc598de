package main

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	collmetrics "go.opentelemetry.io/proto/otlp/collector/metrics/v1"
	colltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	metricspb "go.opentelemetry.io/proto/otlp/metrics/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP/HTTP collector started in the test: it decodes
// what tokentap exports (protobuf) and keeps it.
type otlpReceiver struct {
	url      string
	mu       sync.Mutex
	spans    []*tracepb.Span
	service  string
	metrics  map[string]*metricspb.Metric
	hang     chan struct{} // non-nil: every export waits until it is closed
	requests int
}

func startReceiver(t *testing.T, hang bool) *otlpReceiver {
	t.Helper()
	r := &otlpReceiver{metrics: map[string]*metricspb.Metric{}}
	if hang {
		r.hang = make(chan struct{})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/traces", func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		r.requests++
		r.mu.Unlock()
		if r.hang != nil {
			<-r.hang
			return
		}
		var m colltrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &m); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		r.mu.Lock()
		for _, rs := range m.ResourceSpans {
			for _, a := range rs.Resource.Attributes {
				if a.Key == "service.name" {
					r.service = a.Value.GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				r.spans = append(r.spans, ss.Spans...)
			}
		}
		r.mu.Unlock()
		out, _ := proto.Marshal(&colltrace.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	})
	mux.HandleFunc("/v1/metrics", func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		if r.hang != nil {
			<-r.hang
			return
		}
		var m collmetrics.ExportMetricsServiceRequest
		if err := proto.Unmarshal(body, &m); err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		r.mu.Lock()
		for _, rm := range m.ResourceMetrics {
			for _, sm := range rm.ScopeMetrics {
				for _, mt := range sm.Metrics {
					r.metrics[mt.Name] = mt
				}
			}
		}
		r.mu.Unlock()
		out, _ := proto.Marshal(&collmetrics.ExportMetricsServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.Write(out)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() {
		if r.hang != nil {
			close(r.hang)
		}
		srv.Close()
	})
	r.url = "http://" + ln.Addr().String()
	return r
}

func (r *otlpReceiver) spansNamed(prefix string) []*tracepb.Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*tracepb.Span
	for _, s := range r.spans {
		if strings.HasPrefix(s.Name, prefix) {
			out = append(out, s)
		}
	}
	return out
}

func attrs(kvs []*commonpb.KeyValue) map[string]*commonpb.AnyValue {
	m := map[string]*commonpb.AnyValue{}
	for _, kv := range kvs {
		m[kv.Key] = kv.Value
	}
	return m
}

// tracedBackend is mockllm (or a 503) that keeps the traceparent of each
// request it gets.
func tracedBackend(t *testing.T, fail bool) (string, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var got []string
	mock := mockllm.New(mockllm.Options{TokenGap: time.Millisecond, PrefillBase: 2 * time.Millisecond})
	h := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		got = append(got, req.Header.Get("traceparent"))
		mu.Unlock()
		if fail {
			w.WriteHeader(503)
			return
		}
		mock.ServeHTTP(w, req)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String(), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(got)
	}
}

func postStream(t *testing.T, url, traceparent string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(`{"model":"llama-3","stream":true,"stream_options":{"include_usage":true},"max_tokens":6,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	if traceparent != "" {
		req.Header.Set("traceparent", traceparent)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !bytes.Contains(body, []byte("[DONE]")) {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
}

// One span per request, a child of the client's traceparent, whose
// context goes upstream; the failed-over attempts as its children; the
// GenAI attributes and metrics with the conventions' buckets, decoded
// from what an OTLP/HTTP collector receives. The SDK's environment
// variables set the batch delay and the metric interval.
func TestOTelSpansAndMetrics(t *testing.T) {
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
	t.Setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
	rcv := startReceiver(t, false)
	bad, badGot := tracedBackend(t, true)
	good, goodGot := tracedBackend(t, false)
	listen, adm := freeAddr(t), freeAddr(t)
	cfg := writeFile(t, fmt.Sprintf(`listen: %s
admin: %s
access_log: ""
models: {allow: [llama-3]}
otel: {endpoint: %s, service_name: tokentap-test, sample: 1.0}
routes:
  - name: chat
    prefix: /
    balance: least_inflight
    upstreams:
      - {name: bad, url: %q, weight: 1000}
      - {name: good, url: %q, weight: 1}
    failover: {on: [status_5xx]}
`, listen, adm, rcv.url, bad, good))
	r := startRun(t, []string{"-config", cfg})
	defer r.stop()
	waitUp(t, "http://"+adm+"/healthz")

	clientTrace, clientSpan := "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	postStream(t, "http://"+listen+"/v1/chat/completions", "00-"+clientTrace+"-"+clientSpan+"-01")
	postStream(t, "http://"+listen+"/v1/chat/completions", "")

	var spans, attempts []*tracepb.Span
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		spans, attempts = rcv.spansNamed("chat "), rcv.spansNamed("attempt ")
		if len(spans) >= 2 && len(attempts) >= 2 {
			break
		}
	}
	var traced, root *tracepb.Span
	for _, s := range spans {
		if hex.EncodeToString(s.TraceId) == clientTrace {
			traced = s
		} else {
			root = s
		}
	}
	if traced == nil || root == nil {
		t.Fatalf("spans: %v", spans)
	}
	if hex.EncodeToString(traced.ParentSpanId) != clientSpan || traced.Kind != tracepb.Span_SPAN_KIND_SERVER || traced.Name != "chat llama-3" {
		t.Fatalf("the request's span: parent %x kind %v name %q", traced.ParentSpanId, traced.Kind, traced.Name)
	}
	if len(root.ParentSpanId) != 0 {
		t.Fatalf("a request without traceparent starts a trace: parent %x", root.ParentSpanId)
	}
	// The upstreams got tokentap's span as the parent, on both attempts.
	want := "00-" + clientTrace + "-" + hex.EncodeToString(traced.SpanId) + "-01"
	if g := goodGot(); len(g) != 2 || g[0] != want || g[1] != "00-"+hex.EncodeToString(root.TraceId)+"-"+hex.EncodeToString(root.SpanId)+"-01" {
		t.Fatalf("good upstream got traceparent %q, want %q first", g, want)
	}
	if g := badGot(); len(g) < 1 || g[0] != want {
		t.Fatalf("bad upstream got traceparent %q, want %q", g, want)
	}

	a := attrs(traced.Attributes)
	str := func(k string) string { return a[k].GetStringValue() }
	num := func(k string) int64 { return a[k].GetIntValue() }
	_, goodPort, _ := net.SplitHostPort(strings.TrimPrefix(good, "http://"))
	for k, v := range map[string]string{
		"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "llama-3",
		"gen_ai.response.model": "llama-3", "server.address": "127.0.0.1", "tokentap.route": "chat",
		"tokentap.upstream": "good", "tokentap.outcome": "ok",
	} {
		if str(k) != v {
			t.Errorf("%s = %q, want %q", k, str(k), v)
		}
	}
	if fmt.Sprint(num("server.port")) != goodPort || num("gen_ai.request.max_tokens") != 6 || !a["gen_ai.request.stream"].GetBoolValue() ||
		num("gen_ai.usage.output_tokens") != 6 || num("gen_ai.usage.input_tokens") <= 0 {
		t.Errorf("port %d max_tokens %d stream %v usage %d/%d", num("server.port"), num("gen_ai.request.max_tokens"),
			a["gen_ai.request.stream"], num("gen_ai.usage.input_tokens"), num("gen_ai.usage.output_tokens"))
	}
	if fr := a["gen_ai.response.finish_reasons"].GetArrayValue(); fr == nil || len(fr.Values) != 1 || fr.Values[0].GetStringValue() != "length" {
		t.Errorf("finish reasons %v", fr)
	}
	if ttfc := a["gen_ai.response.time_to_first_chunk"].GetDoubleValue(); ttfc <= 0 || ttfc > 5 {
		t.Errorf("time_to_first_chunk %v", ttfc)
	}
	if _, ok := a["tokentap.overhead_ms"]; !ok {
		t.Error("no tokentap.overhead_ms")
	}
	if _, ok := a["tokentap.queue_ms"]; !ok {
		t.Error("no tokentap.queue_ms")
	}
	var events []string
	for _, e := range traced.Events {
		events = append(events, e.Name)
		if e.TimeUnixNano < traced.StartTimeUnixNano || e.TimeUnixNano > traced.EndTimeUnixNano {
			t.Errorf("event %s outside its span", e.Name)
		}
	}
	if !slices.Contains(events, "tokentap.first_token") || !slices.Contains(events, "tokentap.first_answer_token") {
		t.Errorf("events %v", events)
	}

	// The failover: two attempts under the request's span, the failed
	// one first.
	var mine []*tracepb.Span
	for _, s := range attempts {
		if bytes.Equal(s.ParentSpanId, traced.SpanId) {
			mine = append(mine, s)
		}
	}
	sort.Slice(mine, func(i, j int) bool { return mine[i].StartTimeUnixNano < mine[j].StartTimeUnixNano })
	if len(mine) != 2 || mine[0].Name != "attempt bad" || mine[1].Name != "attempt good" ||
		attrs(mine[0].Attributes)["error.type"].GetStringValue() != "status_5xx" || mine[0].Kind != tracepb.Span_SPAN_KIND_CLIENT ||
		mine[0].EndTimeUnixNano > mine[1].StartTimeUnixNano || mine[1].EndTimeUnixNano > traced.EndTimeUnixNano {
		t.Fatalf("attempts %v", mine)
	}
	if rcv.service != "tokentap-test" {
		t.Errorf("service.name %q", rcv.service)
	}

	// The metrics, with the conventions' names and buckets.
	buckets := map[string][]float64{
		"gen_ai.client.operation.duration":              {0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92},
		"gen_ai.client.operation.time_to_first_chunk":   {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0},
		"gen_ai.client.operation.time_per_output_chunk": {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5},
		"gen_ai.client.token.usage":                     {1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864},
		"gen_ai.server.time_to_first_token":             {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0},
		"gen_ai.server.time_per_output_token":           {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5},
		"gen_ai.server.request.duration":                {0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92},
	}
	var got map[string]*metricspb.Metric
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		rcv.mu.Lock()
		got = copyMetrics(rcv.metrics)
		rcv.mu.Unlock()
		if len(got) >= len(buckets) && count(got["gen_ai.client.operation.duration"]) >= 2 {
			break
		}
	}
	for name, b := range buckets {
		m := got[name]
		if m == nil || m.GetHistogram() == nil || len(m.GetHistogram().DataPoints) == 0 {
			t.Errorf("metric %s not received", name)
			continue
		}
		dp := m.GetHistogram().DataPoints[0]
		if !slices.Equal(dp.ExplicitBounds, b) {
			t.Errorf("%s buckets %v", name, dp.ExplicitBounds)
		}
		p := attrs(dp.Attributes)
		if p["gen_ai.operation.name"].GetStringValue() != "chat" || p["gen_ai.request.model"].GetStringValue() != "llama-3" {
			t.Errorf("%s attributes %v", name, dp.Attributes)
		}
	}
	// Every point of every metric carries its route and operation: the
	// output-token usage point lost its route when the input's was made
	// from the same slice (NewSet sorts what it is given).
	for name, m := range got {
		if m.GetHistogram() == nil {
			continue
		}
		for _, dp := range m.GetHistogram().DataPoints {
			p := attrs(dp.Attributes)
			if p["tokentap.route"].GetStringValue() == "" || p["gen_ai.operation.name"].GetStringValue() != "chat" {
				t.Errorf("%s: a point without its route or operation: %v", name, dp.Attributes)
			}
		}
	}
	// Every inter-token gap of the two streams (5 each) is a chunk's time.
	if n := count(got["gen_ai.client.operation.time_per_output_chunk"]); n != 10 {
		t.Errorf("time_per_output_chunk count %d, want 10", n)
	}
	if n := count(got["gen_ai.client.token.usage"]); n != 4 {
		t.Errorf("token.usage count %d, want 4 (input and output of two)", n)
	}
}

// TestOTelSemconvSwitch: with otel.semconv latest, or the conventions'
// own switch in OTEL_SEMCONV_STABILITY_OPT_IN, an OTLP receiver sees the
// names of semantic-conventions-genai v0.1.0 (the inference histograms
// and the usage counters) and none of today's; with both, both; without
// either, today's alone.
func TestOTelSemconvSwitch(t *testing.T) {
	wait.Long(t, "exports under three naming modes")
	t.Setenv("OTEL_METRIC_EXPORT_INTERVAL", "200")
	latest := []string{"gen_ai.client.inference.duration", "gen_ai.client.inference.time_to_first_chunk",
		"gen_ai.client.inference.time_per_output_chunk", "gen_ai.client.inference.usage.input_tokens", "gen_ai.client.inference.usage.output_tokens"}
	today := []string{"gen_ai.client.operation.duration", "gen_ai.client.operation.time_to_first_chunk", "gen_ai.client.token.usage"}
	for _, c := range []struct {
		name, setting, env string
		want, not          []string
	}{
		{"latest", "semconv: latest, ", "", latest, today},
		{"env", "", "gen_ai_latest_experimental", latest, today},
		{"both", "semconv: both, ", "", append(slices.Clone(latest), today...), nil},
		{"default", "", "", today, latest},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("OTEL_SEMCONV_STABILITY_OPT_IN", c.env)
			rcv := startReceiver(t, false)
			up, _ := tracedBackend(t, false)
			listen, adm := freeAddr(t), freeAddr(t)
			cfg := writeFile(t, fmt.Sprintf("listen: %s\nadmin: %s\naccess_log: \"\"\nmodels: {allow: [llama-3]}\notel: {%sendpoint: %s}\nupstream: %s\n",
				listen, adm, c.setting, rcv.url, up))
			r := startRun(t, []string{"-config", cfg})
			defer r.stop()
			waitUp(t, "http://"+adm+"/healthz")
			postStream(t, "http://"+listen+"/v1/chat/completions", "")
			var got map[string]*metricspb.Metric
			for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				rcv.mu.Lock()
				got = copyMetrics(rcv.metrics)
				rcv.mu.Unlock()
				if got[c.want[0]] != nil && got[c.want[len(c.want)-1]] != nil {
					break
				}
			}
			for _, n := range c.want {
				if got[n] == nil {
					t.Errorf("%s not received", n)
				}
			}
			for _, n := range c.not {
				if got[n] != nil {
					t.Errorf("%s received, want it not emitted", n)
				}
			}
			if m := got["gen_ai.client.inference.usage.output_tokens"]; m != nil {
				if sum := m.GetSum(); sum == nil || !sum.IsMonotonic || len(sum.DataPoints) == 0 || sum.DataPoints[0].GetAsInt() <= 0 {
					t.Errorf("output token usage is not a counter with the stream's tokens: %v", m)
				}
			}
		})
	}
}

func copyMetrics(m map[string]*metricspb.Metric) map[string]*metricspb.Metric {
	out := make(map[string]*metricspb.Metric, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func count(m *metricspb.Metric) uint64 {
	if m == nil || m.GetHistogram() == nil {
		return 0
	}
	var n uint64
	for _, dp := range m.GetHistogram().DataPoints {
		n += dp.Count
	}
	return n
}

// A collector that accepts and never answers: requests through tokentap
// take what they take without OTel (the same backend, through a second
// tokentap with the export off, interleaved), and what could not be queued
// is dropped and counted: the spans past the span queue (the records'
// queue in front of it keeps up, the exporter's goroutine never waiting
// on the collector).
func TestOTelCollectorHangs(t *testing.T) {
	wait.Long(t, "300 requests beside a hung collector")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
	t.Setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
	t.Setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
	t.Setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
	rcv := startReceiver(t, true)
	backend := startMockllm(t, mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond})
	start := func(otel string) (string, string) {
		listen, adm := freeAddr(t), freeAddr(t)
		cfg := writeFile(t, fmt.Sprintf("listen: %s\nadmin: %s\naccess_log: \"\"\nupstream: %s\n%s", listen, adm, backend, otel))
		r := startRun(t, []string{"-config", cfg})
		t.Cleanup(r.stop)
		waitUp(t, "http://"+adm+"/healthz")
		return "http://" + listen + "/v1/chat/completions", "http://" + adm
	}
	traced, tracedAdmin := start(fmt.Sprintf("otel: {endpoint: %s, queue: 8}\n", rcv.url))
	plain, _ := start("")
	ttft := func(url string) time.Duration {
		t0 := time.Now()
		resp, err := http.Post(url, "application/json", strings.NewReader(`{"model":"m","stream":true,"max_tokens":2,"messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		buf := make([]byte, 1)
		if _, err := resp.Body.Read(buf); err != nil {
			t.Fatal(err)
		}
		d := time.Since(t0)
		io.Copy(io.Discard, resp.Body)
		return d
	}
	before := dropped(getText(t, tracedAdmin+"/metrics"))
	var withOTel, without []time.Duration
	for range 150 {
		withOTel = append(withOTel, ttft(traced))
		without = append(without, ttft(plain))
	}
	slices.Sort(withOTel)
	slices.Sort(without)
	a, b := withOTel[len(withOTel)/2], without[len(without)/2]
	t.Logf("median time to the first byte: %v with a hung collector, %v without OTel", a, b)
	if a > b*3/2+2*time.Millisecond {
		t.Errorf("a hung collector slowed requests: median %v against %v", a, b)
	}
	rcv.mu.Lock()
	n := rcv.requests
	rcv.mu.Unlock()
	if n == 0 {
		t.Error("the collector was never called")
	}
	text := getText(t, tracedAdmin+"/metrics")
	if after := dropped(text); after <= before {
		t.Errorf("nothing counted as dropped (%v before the requests, %v after):\n%s", before, after, grepLines(text, "tokentap_otel"))
	}
}

// dropped is the OTel data counted as dropped, records and spans, in a
// /metrics text.
func dropped(text string) float64 {
	var n float64
	for _, l := range strings.Split(text, "\n") {
		if rest, ok := strings.CutPrefix(l, "tokentap_otel_dropped_total{"); ok {
			if _, v, ok := strings.Cut(rest, "} "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				n += f
			}
		}
	}
	return n
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
