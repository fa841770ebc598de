package telemetry

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// benchRecord is a streamed chat completion as tokentap records it, with
// its 32 token gaps.
func benchRecord(i int) (metrics.Record, []time.Duration) {
	r := metrics.Record{Route: "chat", Model: "llama-3-8b", ResponseModel: "llama-3-8b", Dialect: "openai", Stream: true,
		Status: 200, Outcome: metrics.OutcomeOK, RequestID: "0123456789abcdef0123456789abcdef", Tenant: "team-a",
		Upstream: "gpu-a", UpstreamAddr: "10.0.0.7:8000", Start: time.Unix(1_800_000_000, 0),
		TTFT: 80 * time.Millisecond, TTFA: 80 * time.Millisecond, E2E: 400 * time.Millisecond, TPOT: 10 * time.Millisecond,
		ClientTTFT: 81 * time.Millisecond, ClientE2E: 401 * time.Millisecond, ServerTTFT: -1, Queue: 0, Overhead: 200 * time.Microsecond,
		InputTokens: 512, OutputTokens: 32, TokensSource: "usage", CachedTokens: 128, FinishReason: "stop", MaxTokens: 256,
		SLOJudged: true}
	r.Trace.TraceID[0], r.Trace.SpanID[0], r.Trace.SpanID[1], r.Trace.Sampled = 1, byte(i), byte(i>>8), true
	gaps := make([]time.Duration, 32)
	for k := range gaps {
		gaps[k] = 10 * time.Millisecond
	}
	return r, gaps
}

// BenchmarkExport is the exporter's work for one record, on its own
// goroutine: the request's span and the GenAI metrics (semconv: both),
// with the batching and the OTLP encoding to a collector on loopback
// amortised in (Shutdown sends what is left, within the timing). This is the CPU OTel adds
// to a request; nothing of it is on the request's path.
func BenchmarkExport(b *testing.B) {
	for _, c := range []struct {
		name           string
		traces, metric bool
	}{{"traces", true, false}, {"metrics", false, true}, {"both", true, true}} {
		b.Run(c.name, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			_, stop := collector(b, ln, false)
			defer stop()
			e, err := New(context.Background(), Config{Endpoint: "http://" + ln.Addr().String(), Traces: c.traces, Metrics: c.metric,
				Sample: 1, Semconv: SemconvBoth})
			if err != nil {
				b.Fatal(err)
			}
			recs := make([]item, 256)
			for i := range recs {
				r, gaps := benchRecord(i)
				r.Trace.Sampled = c.traces // as ObserveGaps sets it
				recs[i] = item{rec: r, gaps: gaps, model: r.Model}
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				it := recs[i%len(recs)]
				e.export(&it)
				i++
			}
			// What is batched is sent, and the metrics collected and
			// sent, within the timing.
			if err := e.Shutdown(context.Background()); err != nil {
				b.Fatal(err)
			}
		})
	}
}
