// Package telemetry exports tokentap's records to an OpenTelemetry
// collector over OTLP/HTTP: one span per request (a child of the client's
// traceparent, its failed-over attempts as child spans) and the GenAI
// metrics, both named and attributed by the GenAI semantic conventions.
//
// Nothing of it runs on a request's path but StartTrace (parse the
// client's traceparent, pick the span's IDs, decide sampling: no
// allocation) and a non-blocking send of the finished record to the
// exporter's goroutine. That goroutine writes the spans in OTLP's
// encoding into batches (wire.go, batch.go) and adds the metrics to its
// own aggregation (instruments.go, collect.go): a record costs about 2 µs
// there, where the SDK's spans and instruments cost 35. The OTLP
// exporters of the official Go SDK send both, with their configuration,
// retries and OTEL_EXPORTER_OTLP_* variables. A slow, failing or absent
// collector fills the queues, and what does not fit is dropped and
// counted (tokentap_otel_dropped_total), never waited for.
//
//	exp, err := telemetry.New(ctx, telemetry.Config{Endpoint: "http://collector:4318", Traces: true, Metrics: true, Sample: 1})
//	p, _ := proxy.New(cfg, proxy.Options{Tracer: exp, Sinks: []metrics.Sink{exp}})
//	defer exp.Shutdown(ctx)
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/internal/inbox"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlpmetric/otlpmetrichttp"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
)

// Config is the top-level otel section. The SDK's environment variables
// (OTEL_EXPORTER_OTLP_*, OTEL_BSP_* but the batcher's queue of records,
// which is Queue, OTEL_METRIC_EXPORT_INTERVAL and _TIMEOUT,
// OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) keep their meaning for
// what the config leaves unset.
type Config struct {
	// Endpoint is the collector's OTLP/HTTP base URL
	// (http://collector:4318); the signals go to /v1/traces and
	// /v1/metrics under it. Empty: OTEL_EXPORTER_OTLP_ENDPOINT and the
	// per-signal variables, else the SDK's default.
	Endpoint string
	// ServiceName is the resource's service.name (OTEL_SERVICE_NAME wins).
	ServiceName    string
	ServiceVersion string
	Traces         bool
	Metrics        bool
	// Sample is the fraction of traces started here that are recorded;
	// a request with a traceparent follows its sampled flag.
	Sample float64
	// Headers are sent with every export (a collector's credentials),
	// besides OTEL_EXPORTER_OTLP_HEADERS.
	Headers map[string]string
	// Queue bounds the records waiting for the exporter's goroutine
	// (default 8192); past it they are dropped and counted.
	Queue int
	// OnError is told the SDK's errors (a collector that refuses or does
	// not answer), at most one per ErrorEvery (default 1 min); the rest
	// are only counted. Nil: not told.
	OnError    func(error)
	ErrorEvery time.Duration
	// StallAfter is how long an export may go unanswered before the
	// collector's silence is told to OnError (default DefaultStallAfter):
	// the SDK's client retries for up to a minute before it fails one.
	StallAfter time.Duration
	// Semconv chooses the GenAI client metrics' names: SemconvDefault
	// (today's; "" too), SemconvLatest (semantic-conventions-genai
	// v0.1.0's) or SemconvBoth. Left empty, OTEL_SEMCONV_STABILITY_OPT_IN
	// holding gen_ai_latest_experimental (the conventions' own switch)
	// chooses the latest.
	Semconv string
}

// semconvMode is the names the exporter emits under cfg and the
// environment.
func semconvMode(cfg Config) string {
	if cfg.Semconv != "" {
		return cfg.Semconv
	}
	for _, v := range strings.Split(os.Getenv("OTEL_SEMCONV_STABILITY_OPT_IN"), ",") {
		if strings.TrimSpace(v) == "gen_ai_latest_experimental" {
			return SemconvLatest
		}
	}
	return SemconvDefault
}

// Exporter is a proxy.Tracer and a metrics.GapSink.
type Exporter struct {
	cfg     Config
	sampler sdktrace.Sampler
	inbox   *inbox.Box[item]
	stop    chan struct{}
	done    chan struct{}
	once    sync.Once

	spans      *spanBatch  // nil: traces off
	metricSend *metricSend // nil: metrics off
	inst       instruments
}

// scope is the instrumentation scope of what tokentap exports.
const scope = "github.com/tokentap/tokentap"

// New starts an Exporter. It does not contact the collector: exports
// begin with the first batch, and a collector that is down only costs
// dropped batches.
func New(ctx context.Context, cfg Config) (*Exporter, error) {
	if !cfg.Traces && !cfg.Metrics {
		return nil, errors.New("otel: neither traces nor metrics are on")
	}
	if cfg.Sample < 0 || cfg.Sample > 1 {
		return nil, errors.New("otel: sample must be within 0 and 1")
	}
	if cfg.ServiceName == "" {
		cfg.ServiceName = "tokentap"
	}
	if cfg.Queue <= 0 {
		cfg.Queue = 8192
	}
	if cfg.ErrorEvery <= 0 {
		cfg.ErrorEvery = time.Minute
	}
	if cfg.StallAfter <= 0 {
		cfg.StallAfter = DefaultStallAfter
	}
	otel.SetErrorHandler(&errorHandler{tell: cfg.OnError, every: cfg.ErrorEvery})
	res, err := resource.New(ctx,
		resource.WithAttributes(semconv.ServiceName(cfg.ServiceName), semconv.ServiceVersion(cfg.ServiceVersion)),
		resource.WithFromEnv(), resource.WithTelemetrySDK())
	if err != nil && res == nil {
		return nil, err
	}
	e := &Exporter{
		cfg: cfg, sampler: sdktrace.TraceIDRatioBased(cfg.Sample),
		inbox: inbox.New[item](cfg.Queue, wakeAt), stop: make(chan struct{}), done: make(chan struct{}),
	}
	if cfg.Traces {
		opts := []otlptracehttp.Option{}
		if cfg.Endpoint != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(strings.TrimSuffix(cfg.Endpoint, "/")+"/v1/traces"))
		}
		if len(cfg.Headers) > 0 {
			opts = append(opts, otlptracehttp.WithHeaders(cfg.Headers))
		}
		client := otlptracehttp.NewClient(opts...)
		if err := client.Start(ctx); err != nil {
			return nil, err
		}
		e.spans = newSpanBatch(client, res, scope)
		e.spans.stall = cfg.StallAfter
	}
	if cfg.Metrics {
		opts := []otlpmetrichttp.Option{}
		if cfg.Endpoint != "" {
			opts = append(opts, otlpmetrichttp.WithEndpointURL(strings.TrimSuffix(cfg.Endpoint, "/")+"/v1/metrics"))
		}
		if len(cfg.Headers) > 0 {
			opts = append(opts, otlpmetrichttp.WithHeaders(cfg.Headers))
		}
		exp, err := otlpmetrichttp.New(ctx, opts...)
		if err != nil {
			return nil, err
		}
		e.inst = newInstruments(semconvMode(cfg), exp.Temporality(sdkmetric.InstrumentKindHistogram))
		e.metricSend = newMetricSend(exp, res, scope)
		e.metricSend.stall = cfg.StallAfter
	}
	go e.run()
	return e, nil
}

// StartTrace implements proxy.Tracer: the client's span (when its
// traceparent is valid) becomes the parent, whose sampled flag decides;
// otherwise a trace starts here, sampled at the configured fraction.
func (e *Exporter) StartTrace(traceparent, tracestate []byte) metrics.TraceContext {
	var tc metrics.TraceContext
	if !e.cfg.Traces {
		return tc
	}
	tid, parent, sampled, ok := parseTraceparent(traceparent)
	if ok {
		tc.TraceID, tc.ParentID, tc.Sampled = tid, parent, sampled
		if sampled && len(tracestate) > 0 && len(tracestate) <= maxTracestate {
			tc.State = string(tracestate)
		}
	} else {
		putRandom(tc.TraceID[:])
		r := e.sampler.ShouldSample(sdktrace.SamplingParameters{ParentContext: context.Background(), TraceID: tc.TraceID})
		tc.Sampled = r.Decision == sdktrace.RecordAndSample
	}
	putRandom(tc.SpanID[:])
	return tc
}

// maxTracestate bounds the tracestate kept (the specification's 512
// characters, with room).
const maxTracestate = 1024

func putRandom(b []byte) {
	for {
		for i := 0; i < len(b); i += 8 {
			v := rand.Uint64()
			for j := i; j < i+8 && j < len(b); j++ {
				b[j] = byte(v)
				v >>= 8
			}
		}
		for _, c := range b {
			if c != 0 {
				return
			}
		}
	}
}

// Observe implements metrics.Sink.
func (e *Exporter) Observe(r *metrics.Record) { e.ObserveGaps(r, nil) }

// ObserveGaps implements metrics.GapSink: the record (and, for the
// metrics, its gaps) is queued for the exporter's goroutine, or dropped
// and counted when the queue is full.
func (e *Exporter) ObserveGaps(r *metrics.Record, gaps []time.Duration) {
	traced := e.spans != nil && r.Trace.Sampled && r.Trace.Valid()
	if !traced && e.metricSend == nil {
		return
	}
	if e.metricSend == nil || !r.Stream {
		gaps = nil
	}
	if !put(e.inbox, r, r.Series.Model(), traced, gaps) {
		metrics.OTelDropped("records", 1)
	}
}

// run exports the records of the inbox, the spans' batch when it has
// waited its time and the metrics every interval; stopped, what the inbox
// holds, the last batch and the last metrics.
func (e *Exporter) run() {
	defer close(e.done)
	var due, tick <-chan time.Time
	gather := time.NewTicker(gatherEvery)
	defer gather.Stop()
	if e.metricSend != nil {
		tick = e.metricSend.tick.C
	}
	for {
		if e.spans != nil {
			due = e.spans.due
		}
		select {
		case <-e.inbox.Wake:
			e.inbox.Drain(e.export)
		case <-gather.C:
			e.inbox.Drain(e.export)
		case <-due:
			e.spans.flush()
		case <-tick:
			e.metricSend.offer(&e.inst)
		case <-e.stop:
			e.inbox.Drain(e.export)
			e.last()
			return
		}
	}
}

// last hands the last batch and the last metrics over.
func (e *Exporter) last() {
	if e.spans != nil {
		e.spans.close()
	}
	if e.metricSend != nil {
		e.metricSend.close(&e.inst)
	}
}

func (e *Exporter) export(it *item) {
	if it.rec.Trace.Sampled {
		e.span(&it.rec)
	}
	if e.metricSend != nil {
		e.inst.record(&it.rec, it.model, it.gaps)
	}
}

// Shutdown exports what is queued, the last batch and the last metrics,
// within ctx. Records observed afterwards are dropped and counted.
func (e *Exporter) Shutdown(ctx context.Context) error {
	var err error
	e.once.Do(func() {
		e.inbox.Close() // what comes after is dropped and counted
		close(e.stop)
		wait := func(done <-chan struct{}) {
			if err != nil {
				return
			}
			select {
			case <-done:
			case <-ctx.Done():
				err = ctx.Err()
			}
		}
		wait(e.done)
		if e.spans != nil {
			wait(e.spans.done)
		}
		if e.metricSend != nil {
			wait(e.metricSend.done)
		}
		// The exports are stopped even when the queue's goroutine did not
		// finish in time (a collector that hangs): the spans' client
		// cancels its uploads and takes no more, the metrics' export on
		// its way is cancelled and none follows, so nothing is exported
		// after Shutdown returns. Past ctx the clients get closeGrace to
		// close.
		sctx := ctx
		if ctx.Err() != nil {
			var cancel context.CancelFunc
			sctx, cancel = context.WithTimeout(context.WithoutCancel(ctx), closeGrace)
			defer cancel()
		}
		if e.spans != nil {
			err = errors.Join(err, e.spans.client.Stop(sctx))
		}
		if e.metricSend != nil {
			e.metricSend.cancel()
			err = errors.Join(err, e.metricSend.exp.Shutdown(sctx))
		}
	})
	return err
}

// closeGrace is what the export clients get to close once Shutdown's
// context is done: the most Shutdown takes past it.
const closeGrace = 500 * time.Millisecond

// DefaultStallAfter is Config.StallAfter's default: a collector that hung
// said nothing for 36 s before (the SDK's retries give up after a minute).
const DefaultStallAfter = 10 * time.Second

// watchStall tells, once after has passed, that an export of signal is
// not answered; the returned function ends the watch (the export
// returned).
func watchStall(signal string, after time.Duration) func() {
	t := time.AfterFunc(after, func() {
		otel.Handle(fmt.Errorf("the collector has not answered a %s export for %v (still trying; what does not fit is dropped and counted)", signal, after))
	})
	return func() { t.Stop() }
}

// errorHandler passes the SDK's errors on, at most one per every (the
// SDK's default prints each one).
type errorHandler struct {
	tell  func(error)
	every time.Duration
	last  atomic.Int64 // unix nanoseconds of the last told
}

func (h *errorHandler) Handle(err error) {
	if h.tell == nil {
		return
	}
	now := time.Now().UnixNano()
	last := h.last.Load()
	if now-last < int64(h.every) || !h.last.CompareAndSwap(last, now) {
		return
	}
	h.tell(err)
}
