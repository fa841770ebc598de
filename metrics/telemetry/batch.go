package telemetry

import (
	"context"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/sdk/resource"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	resourcepb "go.opentelemetry.io/proto/otlp/resource/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// spanBatch gathers the encoded spans into batches and uploads them with
// the OTLP exporter's client (its endpoint, headers, TLS, compression,
// timeout and retries, from the config and OTEL_EXPORTER_OTLP_*), one
// batch at a time, on a goroutine of its own. It keeps the SDK batcher's
// settings: OTEL_BSP_MAX_EXPORT_BATCH_SIZE (at most
// OTEL_BSP_MAX_QUEUE_SIZE, 2,048), OTEL_BSP_SCHEDULE_DELAY (5 s, the
// longest a span waits for its batch) and OTEL_BSP_EXPORT_TIMEOUT (30 s,
// one upload's bound). A batch is 2,048 spans unless the variable says
// otherwise, where the SDK's is 512: each upload costs the process a
// few milliseconds whatever its size (the client encodes it anew, into
// new memory, and writes it out), and at 1,000 requests/s batches of 512
// cost 4 µs a request more than batches of 2,048 (about 2 MB, a tenth of
// the OpenTelemetry Collector's default bound on a request).
//
// The batch being filled is the exporter's goroutine's; a full one is
// queued for the uploader, up to OTEL_BSP_MAX_QUEUE_SIZE spans (2048)
// waiting. Past that (a collector slower than the traffic, or hung) the
// batch is dropped and counted, as the SDK's batcher drops spans: the
// exporter's goroutine never waits on the collector, so the metrics go on
// being recorded and exported. The buffers go back and forth and keep
// their size (under maxKeptBatch).
type spanBatch struct {
	client  otlptrace.Client
	res     *resourcepb.Resource
	scope   *commonpb.InstrumentationScope
	max     int
	delay   time.Duration
	timeout time.Duration
	stall   time.Duration // an export unanswered this long is told (watchStall)
	// json: the client sends OTLP/HTTP's JSON (OTEL_EXPORTER_OTLP_PROTOCOL
	// or _TRACES_PROTOCOL http/json), which writes known fields only: a
	// batch is decoded into the generated messages before it goes.
	json bool

	// The exporter's goroutine's.
	buf     []byte               // the batch: ScopeSpans' spans field, encoded
	n       int                  // spans in buf
	scratch []byte               // the span being written, before its length is known
	attrs   []attribute.KeyValue // and its attributes
	timer   *time.Timer
	due     <-chan time.Time // timer.C while a batch waits for it, else nil

	full chan sentSpans // the batches queued
	free chan []byte    // the buffers of the batches sent
	done chan struct{}  // closed when the uploader has returned
}

type sentSpans struct {
	b []byte
	n int
}

// defaultBatch is the spans a batch holds when OTEL_BSP_MAX_EXPORT_BATCH_SIZE
// does not say.
const defaultBatch = 2048

// maxKeptBatch bounds a batch's buffer kept for the next: one grown past
// it by long attributes (a model's name is the client's) is let go.
const maxKeptBatch = 4 << 20

func newSpanBatch(client otlptrace.Client, res *resource.Resource, scope string) *spanBatch {
	s := &spanBatch{
		client: client, res: resourceOf(res), scope: &commonpb.InstrumentationScope{Name: scope},
		max: envInt("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", defaultBatch), delay: envMillis("OTEL_BSP_SCHEDULE_DELAY", 5000),
		timeout: envMillis("OTEL_BSP_EXPORT_TIMEOUT", 30000),
		timer:   time.NewTimer(time.Hour), done: make(chan struct{}),
	}
	s.json = otlpProtocol("TRACES") == "http/json"
	if s.json {
		res := &resourcepb.Resource{}
		if err := proto.Unmarshal(s.res.ProtoReflect().GetUnknown(), res); err == nil {
			s.res = res
		}
	}
	queue := envInt("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
	s.max = min(s.max, queue)
	s.full = make(chan sentSpans, queue/s.max)
	s.free = make(chan []byte, queue/s.max+1)
	s.timer.Stop()
	go s.upload()
	return s
}

// resourceOf is res as OTLP's Resource: its attributes, written as the
// spans' are, stand as the message's fields.
func resourceOf(res *resource.Resource) *resourcepb.Resource {
	var b []byte
	for _, kv := range res.Attributes() {
		b = appendKeyValue(b, resourceAttributes, kv)
	}
	m := &resourcepb.Resource{}
	m.ProtoReflect().SetUnknown(protoreflect.RawFields(b))
	return m
}

// begin returns the buffer to write a span's fields into, for add.
func (s *spanBatch) begin() []byte { return s.scratch[:0] }

// add puts the span written into the batch, and hands the batch over
// when it is full.
func (s *spanBatch) add(span []byte) {
	s.scratch = span
	s.buf = protowire.AppendTag(s.buf, scopeSpansSpans, protowire.BytesType)
	s.buf = protowire.AppendBytes(s.buf, span)
	s.n++
	if s.n >= s.max {
		s.flush()
	} else if s.n == 1 {
		s.timer.Reset(s.delay)
		s.due = s.timer.C
	}
}

// flush queues the batch for the uploader and takes a buffer of one
// sent, or drops it when the queue is full.
func (s *spanBatch) flush() {
	if s.n == 0 {
		return
	}
	s.timer.Stop()
	s.due = nil
	select {
	case s.full <- sentSpans{s.buf, s.n}:
		select {
		case s.buf = <-s.free:
		default:
			s.buf = nil
		}
	default:
		metrics.OTelDropped("spans", s.n)
	}
	s.buf, s.n = s.buf[:0], 0
}

// close hands the last batch over; the uploader returns once it is sent.
func (s *spanBatch) close() {
	s.flush()
	close(s.full)
}

func (s *spanBatch) upload() {
	defer close(s.done)
	for b := range s.full {
		s.send(b)
		if cap(b.b) <= maxKeptBatch {
			select {
			case s.free <- b.b[:0]:
			default:
			}
		}
	}
}

// send uploads one batch: the batch's spans stand as the fields of the
// request's one ScopeSpans, which the client encodes with the rest.
func (s *spanBatch) send(b sentSpans) {
	ss := &tracepb.ScopeSpans{}
	if !s.json {
		ss.ProtoReflect().SetUnknown(protoreflect.RawFields(b.b))
	} else if err := proto.Unmarshal(b.b, ss); err != nil {
		metrics.OTelDropped("spans", b.n)
		otel.Handle(err)
		return
	}
	ss.Scope = s.scope
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	defer watchStall("traces", s.stall)()
	err := s.client.UploadTraces(ctx, []*tracepb.ResourceSpans{{Resource: s.res, ScopeSpans: []*tracepb.ScopeSpans{ss}}})
	if err != nil {
		metrics.OTelExportError("traces")
		metrics.OTelDropped("spans", b.n)
		otel.Handle(err)
		return
	}
	metrics.OTelSpansExported(b.n)
}

// otlpProtocol is the OTLP protocol the environment asks of a signal
// ("TRACES", "METRICS"): its own variable, else the general one.
func otlpProtocol(signal string) string {
	if v, ok := os.LookupEnv("OTEL_EXPORTER_OTLP_" + signal + "_PROTOCOL"); ok {
		return strings.TrimSpace(v)
	}
	return strings.TrimSpace(os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL"))
}

// envInt and envMillis read a positive setting from the environment, as
// the SDK does: absent or not a positive number, def.
func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func envMillis(name string, def int) time.Duration {
	return time.Duration(envInt(name, def)) * time.Millisecond
}
