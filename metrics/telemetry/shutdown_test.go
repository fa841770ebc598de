package telemetry

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// collector serves OTLP/HTTP at ln, counting the exports; hang: it takes
// them and never answers.
func collector(t testing.TB, ln net.Listener, hang bool) (*atomic.Int64, func()) {
	var calls atomic.Int64
	release := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		io.Copy(io.Discard, r.Body)
		if hang {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
	})}
	go srv.Serve(ln)
	return &calls, func() { close(release); srv.Close() }
}

// TestShutdownStopsExportsWhenCollectorHangs: a collector that takes every
// export and never answers, so that the queue cannot drain within
// Shutdown's context. Shutdown still stops the exports: once that
// collector is gone and another server listens at its address, the new
// one hears nothing. (Before, the periodic metric reader outlived
// Shutdown and exported to whatever listened there next, for the life of
// the process.)
func TestShutdownStopsExportsWhenCollectorHangs(t *testing.T) {
	long(t, "a hung collector's exports")
	t.Setenv("OTEL_METRIC_EXPORT_INTERVAL", "50")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
	// A span queue this small fills at once (the rest is dropped), and
	// the upload that hangs holds Shutdown past its context.
	t.Setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
	t.Setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	hung, closeHung := collector(t, ln, true)
	e, err := New(context.Background(), Config{Endpoint: "http://" + addr, Metrics: true, Traces: true, Sample: 1})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		r := metrics.Record{Route: "r", E2E: 20 * time.Millisecond, ClientE2E: -1}
		r.Trace.TraceID[0], r.Trace.SpanID[0], r.Trace.SpanID[1], r.Trace.Sampled = 1, 1, byte(i), true
		e.Observe(&r)
	}
	for deadline := time.Now().Add(10 * time.Second); hung.Load() < 2; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the collector did not get both signals' exports")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	if err := e.Shutdown(ctx); err == nil {
		t.Error("Shutdown reported success while the collector hung")
	}
	cancel()
	closeHung()
	ln2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the address could not be taken again: %v", err)
	}
	next, closeNext := collector(t, ln2, false)
	defer closeNext()
	time.Sleep(1500 * time.Millisecond) // what was queued when the hung exports ended goes out
	n := next.Load()
	time.Sleep(time.Second) // twenty metric intervals
	if m := next.Load(); m != n {
		t.Errorf("%d exports reached the next server at the collector's address, a second after Shutdown", m-n)
	}
}

// TestAHungCollectorIsToldAndShutdownIsShort: a collector that takes every
// export and never answers. Its silence is told (OnError) once an export
// has waited StallAfter (200 ms here), long before the SDK's retries
// give up; Shutdown with a context of 300 ms returns within it and the
// clients' closeGrace.
func TestAHungCollectorIsToldAndShutdownIsShort(t *testing.T) {
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "10")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, closeHung := collector(t, ln, true)
	defer closeHung()
	told := make(chan error, 8)
	e, err := New(context.Background(), Config{Endpoint: "http://" + ln.Addr().String(), Traces: true, Sample: 1, StallAfter: 200 * time.Millisecond,
		OnError: func(err error) {
			select {
			case told <- err:
			default:
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	r := metrics.Record{Route: "r", E2E: 20 * time.Millisecond, ClientE2E: -1}
	r.Trace.TraceID[0], r.Trace.SpanID[0], r.Trace.Sampled = 1, 1, true
	e.Observe(&r)
	select {
	case err := <-told:
		if !strings.Contains(err.Error(), "has not answered a traces export") {
			t.Errorf("told %v", err)
		}
	case <-time.After(time.Minute): // a hang, not a slow machine
		t.Fatal("a hung collector was never told")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	e.Shutdown(ctx)
	if d := time.Since(start); d > 300*time.Millisecond+closeGrace+3*time.Second { // bounded from above generously: a busy machine
		t.Errorf("Shutdown took %v with a context of 300 ms", d)
	}
}
