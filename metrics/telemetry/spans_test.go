package telemetry

import (
	"context"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel/attribute"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
)

// diff is "" when the messages are equal, else both in text form.
func diff(want, got proto.Message) string {
	if proto.Equal(want, got) {
		return ""
	}
	return "want: " + prototext.Format(want) + "\ngot:  " + prototext.Format(got)
}

func str(k, v string) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: v}}}
}

func num(k string, v int64) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_IntValue{IntValue: v}}}
}

func dbl(k string, v float64) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_DoubleValue{DoubleValue: v}}}
}

func boolean(k string, v bool) *commonpb.KeyValue {
	return &commonpb.KeyValue{Key: k, Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_BoolValue{BoolValue: v}}}
}

// spansOf decodes a batch as the collector does: the ScopeSpans message
// whose spans field the batch is.
func spansOf(t *testing.T, batch []byte) []*tracepb.Span {
	t.Helper()
	var ss tracepb.ScopeSpans
	if err := proto.Unmarshal(batch, &ss); err != nil {
		t.Fatalf("the batch is not OTLP: %v", err)
	}
	return ss.Spans
}

// The spans tokentap writes are the messages the generated OTLP code
// decodes them to, field for field: a failed-over request that came with
// a traceparent and a tracestate, and failed (status, error.type), and a
// plain root span that succeeded.
func TestSpanEncodingDecodesToOTLP(t *testing.T) {
	e := &Exporter{spans: &spanBatch{max: 1 << 20, timer: time.NewTimer(time.Hour)}}
	start := time.Unix(1_800_000_000, 123)
	r := metrics.Record{Route: "chat", Model: "llama-3-8b", Dialect: "openai", Path: "/v1/chat/completions", Stream: true,
		Status: 502, Outcome: metrics.OutcomeUpstreamError, Error: "upstream answered 502", RequestID: "req-1", Tenant: "team-a",
		Upstream: "gpu-b", UpstreamAddr: "10.0.0.8:8000", Start: start, TTFT: -1, TTFA: -1, E2E: 300 * time.Millisecond,
		ClientTTFT: -1, ClientE2E: -1, Queue: 2 * time.Millisecond, Overhead: -1, MaxTokens: 64, FinishReason: "length",
		Tries: []metrics.Try{{Upstream: "gpu-a", Addr: "10.0.0.7:8000", Start: start, Duration: 100 * time.Millisecond, Reason: "connect"}}}
	r.Trace = metrics.TraceContext{TraceID: [16]byte{1, 2, 3}, SpanID: [8]byte{4, 5}, ParentID: [8]byte{6, 7}, Sampled: true, State: "vendor=a,other=b"}
	e.span(&r)
	ok := metrics.Record{Route: "embed", Dialect: "openai-embeddings", Outcome: metrics.OutcomeOK, Status: 200, RequestID: "req-2",
		Start: start, TTFT: 40 * time.Millisecond, TTFA: 50 * time.Millisecond, E2E: 60 * time.Millisecond, ClientTTFT: 41 * time.Millisecond,
		ClientE2E: -1, Queue: -1, Overhead: 250 * time.Microsecond, InputTokens: 7, OutputTokens: 0, TokensSource: "usage", SLOJudged: true, SLOMisses: 1,
		Reading: metrics.Reading{Tokens: 9, QoE: 0.75, Fluidity: 0.5, Stall: 120 * time.Millisecond, Stalls: 2, HeldBy: metrics.HopClient}}
	ok.Trace = metrics.TraceContext{TraceID: [16]byte{9}, SpanID: [8]byte{10}, Sampled: true, State: "ignored=without-a-parent"}
	e.span(&ok)

	spans := spansOf(t, e.spans.buf)
	if len(spans) != 4 || e.spans.n != 4 {
		t.Fatalf("%d spans decoded, %d counted; want 4 (the request, its 2 attempts, the second request)", len(spans), e.spans.n)
	}
	ns := func(t time.Time) uint64 { return uint64(t.UnixNano()) }
	want := &tracepb.Span{
		TraceId: r.Trace.TraceID[:], SpanId: r.Trace.SpanID[:], ParentSpanId: r.Trace.ParentID[:], TraceState: "vendor=a,other=b",
		Name: "chat llama-3-8b", Kind: tracepb.Span_SPAN_KIND_SERVER, StartTimeUnixNano: ns(start), EndTimeUnixNano: ns(start.Add(r.E2E)),
		Flags: 0x301,
		Attributes: []*commonpb.KeyValue{str("gen_ai.operation.name", "chat"), str("gen_ai.provider.name", "openai"),
			boolean("gen_ai.request.stream", true), str("tokentap.route", "chat"), str("tokentap.outcome", "upstream_error"),
			str("tokentap.request_id", "req-1"), str("gen_ai.request.model", "llama-3-8b"), num("gen_ai.request.max_tokens", 64),
			str("server.address", "10.0.0.8"), num("server.port", 8000), str("error.type", "upstream_error"),
			num("http.response.status_code", 502), str("tokentap.tenant", "team-a"), str("tokentap.upstream", "gpu-b"),
			dbl("tokentap.queue_ms", 2),
			{Key: "gen_ai.response.finish_reasons", Value: &commonpb.AnyValue{Value: &commonpb.AnyValue_ArrayValue{ArrayValue: &commonpb.ArrayValue{
				Values: []*commonpb.AnyValue{{Value: &commonpb.AnyValue_StringValue{StringValue: "length"}}}}}}}},
		Status: &tracepb.Status{Code: tracepb.Status_STATUS_CODE_ERROR, Message: "upstream answered 502"},
	}
	if d := diff(want, spans[0]); d != "" {
		t.Errorf("the failed request's span :\n%s", d)
	}
	for i, a := range []struct {
		upstream, addr, failure string
		port                    int64
		from, to                time.Time
	}{{"gpu-a", "10.0.0.7", "connect", 8000, start, start.Add(100 * time.Millisecond)},
		{"gpu-b", "10.0.0.8", "upstream_error", 8000, start.Add(100 * time.Millisecond), start.Add(r.E2E)}} {
		got := spans[1+i]
		if len(got.SpanId) != 8 || proto.Equal(&tracepb.Span{SpanId: got.SpanId}, &tracepb.Span{SpanId: r.Trace.SpanID[:]}) {
			t.Errorf("attempt %d: span id %x, want one of its own", i, got.SpanId)
		}
		want := &tracepb.Span{TraceId: r.Trace.TraceID[:], SpanId: got.SpanId, ParentSpanId: r.Trace.SpanID[:], Name: "attempt " + a.upstream,
			Kind: tracepb.Span_SPAN_KIND_CLIENT, StartTimeUnixNano: ns(a.from), EndTimeUnixNano: ns(a.to), Flags: 0x101,
			Attributes: []*commonpb.KeyValue{str("gen_ai.operation.name", "chat"), str("tokentap.upstream", a.upstream),
				str("server.address", a.addr), num("server.port", a.port), str("error.type", a.failure)},
			Status: &tracepb.Status{Code: tracepb.Status_STATUS_CODE_ERROR, Message: a.failure}}
		if d := diff(want, got); d != "" {
			t.Errorf("attempt %d :\n%s", i, d)
		}
	}
	want = &tracepb.Span{
		TraceId: ok.Trace.TraceID[:], SpanId: ok.Trace.SpanID[:], Name: "embeddings", Kind: tracepb.Span_SPAN_KIND_SERVER,
		StartTimeUnixNano: ns(start), EndTimeUnixNano: ns(start.Add(ok.E2E)), Flags: 0x101,
		Attributes: []*commonpb.KeyValue{str("gen_ai.operation.name", "embeddings"), str("gen_ai.provider.name", "openai"),
			boolean("gen_ai.request.stream", false), str("tokentap.route", "embed"), str("tokentap.outcome", "ok"),
			str("tokentap.request_id", "req-2"), num("gen_ai.usage.output_tokens", 0), num("gen_ai.usage.input_tokens", 7),
			dbl("gen_ai.response.time_to_first_chunk", 0.04), num("http.response.status_code", 200),
			dbl("tokentap.overhead_ms", 0.25), dbl("tokentap.client_ttft_ms", 41), dbl("tokentap.qoe", 0.75), dbl("tokentap.fluidity", 0.5),
			dbl("tokentap.stall_ms", 120), num("tokentap.stalls", 2), str("tokentap.held_by", "client"), boolean("tokentap.slo_ok", false)},
		Events: []*tracepb.Span_Event{{Name: "tokentap.first_token", TimeUnixNano: ns(start.Add(40 * time.Millisecond))},
			{Name: "tokentap.first_answer_token", TimeUnixNano: ns(start.Add(50 * time.Millisecond))}},
	}
	if d := diff(want, spans[3]); d != "" {
		t.Errorf("the successful request's span :\n%s", d)
	}
}

// Every attribute type and size the encoder writes decodes to its value:
// lengths that take one, two and three bytes, negative and large
// integers, floats' edges, empty strings and lists.
func TestKeyValueEncodingEdges(t *testing.T) {
	long := string(make([]byte, 20000))
	cases := []*commonpb.KeyValue{str("a", ""), str("b", long[:127]), str("c", long[:128]), str("d", long),
		num("e", -1), num("f", math.MaxInt64), num("g", math.MinInt64), dbl("h", math.Inf(-1)), dbl("i", -0.5),
		boolean("j", false), boolean("k", true)}
	var b []byte
	for _, kv := range cases {
		b = appendKeyValue(b, spanAttributes, toAttr(t, kv))
	}
	b = appendStringsKeyValue(b, spanAttributes, "l")
	b = appendStringsKeyValue(b, spanAttributes, "m", "", long[:300], "x")
	var got tracepb.Span
	if err := proto.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	strs := func(ss ...string) *commonpb.AnyValue {
		var vs []*commonpb.AnyValue
		for _, s := range ss {
			vs = append(vs, &commonpb.AnyValue{Value: &commonpb.AnyValue_StringValue{StringValue: s}})
		}
		return &commonpb.AnyValue{Value: &commonpb.AnyValue_ArrayValue{ArrayValue: &commonpb.ArrayValue{Values: vs}}}
	}
	want := append(cases, &commonpb.KeyValue{Key: "l", Value: strs()}, &commonpb.KeyValue{Key: "m", Value: strs("", long[:300], "x")})
	if d := diff(&tracepb.Span{Attributes: want}, &got); d != "" {
		t.Errorf(":\n%s", d)
	}
}

func toAttr(t *testing.T, kv *commonpb.KeyValue) attribute.KeyValue {
	switch v := kv.Value.Value.(type) {
	case *commonpb.AnyValue_StringValue:
		return attribute.String(kv.Key, v.StringValue)
	case *commonpb.AnyValue_IntValue:
		return attribute.Int64(kv.Key, v.IntValue)
	case *commonpb.AnyValue_DoubleValue:
		return attribute.Float64(kv.Key, v.DoubleValue)
	case *commonpb.AnyValue_BoolValue:
		return attribute.Bool(kv.Key, v.BoolValue)
	}
	t.Fatalf("no attribute for %v", kv)
	return attribute.KeyValue{}
}

// With OTLP/HTTP's JSON asked for (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL),
// whose encoder writes known fields only, the spans and the resource
// still reach the collector.
func TestSpansOverJSON(t *testing.T) {
	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
	bodies := make(chan string, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/v1/traces" {
			bodies <- r.Header.Get("Content-Type") + " " + string(b)
		}
	}))
	defer srv.Close()
	e, err := New(context.Background(), Config{Endpoint: srv.URL, Traces: true, Sample: 1, ServiceName: "svc-json"})
	if err != nil {
		t.Fatal(err)
	}
	r := metrics.Record{Route: "chat", Model: "llama-3-8b", Dialect: "openai", Path: "/v1/chat/completions", Outcome: metrics.OutcomeOK,
		Status: 200, RequestID: "req-json", Start: time.Unix(1_800_000_000, 0), TTFT: -1, TTFA: -1, E2E: time.Second, ClientTTFT: -1,
		Queue: -1, Overhead: -1}
	r.Trace = metrics.TraceContext{TraceID: [16]byte{1}, SpanID: [8]byte{2}, Sampled: true}
	e.Observe(&r)
	if err := e.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case body := <-bodies:
		for _, want := range []string{"application/json", `"chat llama-3-8b"`, `"req-json"`, `"svc-json"`, `"gen_ai.request.model"`} {
			if !strings.Contains(body, want) {
				t.Errorf("the JSON export lacks %s:\n%s", want, body)
			}
		}
	default:
		t.Fatal("nothing exported")
	}
}
