package metrics

import (
	"io"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// fullRecord is a streamed request's record with every usual field set.
func fullRecord() *Record {
	var r Record
	r.Reset()
	r.RequestID = "0123456789abcdef0123456789abcdef"
	r.Route, r.Model, r.Tenant = "chat", "llama-3.1-8b-instruct", "team-a"
	r.Method, r.Path, r.Dialect = "POST", "/v1/chat/completions", "openai"
	r.Status, r.Outcome, r.Stream = 200, OutcomeOK, true
	r.Queue, r.UpstreamTTFB, r.TTFT, r.TTFA = 0, 20*time.Millisecond, 21*time.Millisecond, 21*time.Millisecond
	r.ITLCount, r.ITLMean, r.ITLP50, r.ITLP99, r.ITLMax = 99, 10*time.Millisecond, 10*time.Millisecond, 12*time.Millisecond, 13*time.Millisecond
	r.TPOT, r.E2E, r.Overhead = 10*time.Millisecond, time.Second, 150*time.Microsecond
	r.ClientRTT, r.ClientSRTT, r.ClientTTFT, r.ClientE2E = 50*time.Microsecond, 80*time.Microsecond, 21*time.Millisecond, time.Second
	r.OutputTokens, r.InputTokens, r.TokensSource, r.Events = 100, 512, "usage", 100
	r.BytesIn, r.BytesOut, r.BytesWire, r.BytesAcked = 2048, 20000, 21000, 21000
	r.Class = "s-m"
	return &r
}

// BenchmarkAccessLogRender is the writer goroutine's work per record: the
// record rendered as one JSON line into the pending buffer, written out
// every 64 records.
func BenchmarkAccessLogRender(b *testing.B) {
	// Closed at once: the benchmark is the writer goroutine, on its output.
	a := NewAccessLog(zapcore.AddSync(io.Discard), 1)
	a.Close()
	it := accessItem{rec: *fullRecord()}
	var fields []zap.Field
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		a.handle(&it, &fields)
		if n++; n%64 == 0 {
			a.out.flush()
		}
	}
}

// BenchmarkAccessLogObserve is the relay's side: the record copied into
// the queue, which a writer drains.
func BenchmarkAccessLogObserve(b *testing.B) {
	a := NewAccessLog(zapcore.AddSync(io.Discard), 1<<16)
	defer a.Close()
	r := fullRecord()
	b.ReportAllocs()
	for b.Loop() {
		a.Observe(r)
	}
}
