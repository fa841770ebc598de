package telemetry

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// reference reads a traceparent with the OpenTelemetry SDK's own
// propagator.
func reference(v string) (trace.SpanContext, bool) {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{"traceparent": v})
	sc := trace.SpanContextFromContext(ctx)
	return sc, sc.IsValid()
}

func TestParseTraceparent(t *testing.T) {
	for _, c := range []struct {
		v       string
		ok      bool
		sampled bool
	}{
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", true, true},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", true, false},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03", true, true},
		{"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later", true, true},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later", false, false},
		{"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", false, false},
		{"00-00000000000000000000000000000000-00f067aa0ba902b7-01", false, false},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", false, false},
		{"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", false, false},
		{"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", false, false},
		{"", false, false},
	} {
		tid, pid, sampled, ok := parseTraceparent([]byte(c.v))
		if ok != c.ok || sampled != c.sampled {
			t.Errorf("%q: ok %v sampled %v", c.v, ok, sampled)
		}
		if sc, rok := reference(c.v); rok != ok || (ok && (sc.TraceID() != tid || sc.SpanID() != pid || sc.IsSampled() != sampled)) {
			t.Errorf("%q: the SDK's propagator says %v %v", c.v, rok, sc)
		}
	}
	if n := testing.AllocsPerRun(100, func() {
		parseTraceparent([]byte("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
	}); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

// The parser agrees with the SDK's propagator on any input.
func FuzzTraceparent(f *testing.F) {
	f.Add("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	f.Add("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")
	f.Add("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	f.Fuzz(func(t *testing.T, v string) {
		tid, pid, sampled, ok := parseTraceparent([]byte(v))
		sc, rok := reference(v)
		if ok != rok {
			t.Fatalf("%q: ok %v, the SDK says %v", v, ok, rok)
		}
		if ok && (sc.TraceID() != tid || sc.SpanID() != pid || sc.IsSampled() != sampled) {
			t.Fatalf("%q: %x %x %v, the SDK says %v", v, tid, pid, sampled, sc)
		}
	})
}
