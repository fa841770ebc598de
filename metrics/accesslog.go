package metrics

import (
	"bufio"
	"sync"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

var accessLogDropped = vm.NewCounter("tokentap_access_log_dropped_total")

// AccessLog writes one JSON line per record through zap, from a goroutine of
// its own: Observe only copies the record into a bounded queue, so a slow
// disk never blocks the relay. When the queue is full the record is dropped
// and tokentap_access_log_dropped_total counts it.
//
// Call Close to write what is queued and stop.
type AccessLog struct {
	buf   *bufferedSyncer
	log   *zap.Logger
	queue chan accessItem
	done  chan struct{}
	once  sync.Once
}

type accessItem struct {
	rec   Record
	flush chan struct{} // non-nil: a Flush marker, not a record
}

// NewAccessLog starts an access log writing to w. queueLen <= 0 means 8192.
func NewAccessLog(w zapcore.WriteSyncer, queueLen int) *AccessLog {
	if queueLen <= 0 {
		queueLen = 8192
	}
	enc := zapcore.NewJSONEncoder(zapcore.EncoderConfig{
		TimeKey:        "ts",
		EncodeTime:     zapcore.RFC3339NanoTimeEncoder,
		LineEnding:     zapcore.DefaultLineEnding,
		EncodeDuration: zapcore.StringDurationEncoder,
	})
	// Lines are written in batches: a record after a lull is written at
	// once; while records keep coming, the writer wakes every batchEvery
	// to write and flush what queued up.
	bw := &bufferedSyncer{w: bufio.NewWriterSize(w, 256<<10), ws: w}
	a := &AccessLog{
		buf:   bw,
		log:   zap.New(zapcore.NewCore(enc, bw, zapcore.InfoLevel)),
		queue: make(chan accessItem, queueLen),
		done:  make(chan struct{}),
	}
	go a.run()
	return a
}

// Observe queues r for writing. It never blocks.
func (a *AccessLog) Observe(r *Record) {
	select {
	case a.queue <- accessItem{rec: *r}:
	default:
		accessLogDropped.Inc()
	}
}

// Flush waits until every record queued before the call is written.
func (a *AccessLog) Flush() {
	ch := make(chan struct{})
	select {
	case a.queue <- accessItem{flush: ch}:
		<-ch
	case <-a.done:
	}
}

// Close writes what is queued and stops the writer. Observe must not be
// called after Close.
func (a *AccessLog) Close() {
	a.once.Do(func() {
		close(a.queue)
		<-a.done
		_ = a.log.Sync()
	})
}

// batchEvery is how often the writer drains the queue while records keep
// coming. Between drains records queue up without waking it; when they stop
// coming it blocks on the queue, so an idle proxy has no timer running.
const batchEvery = 5 * time.Millisecond

func (a *AccessLog) run() {
	defer close(a.done)
	fields := make([]zap.Field, 0, 40)
	timer := time.NewTimer(batchEvery)
	timer.Stop()
	for {
		// Idle: block until a record comes; write it at once.
		it, ok := <-a.queue
		if !ok {
			return
		}
		a.write(it, &fields)
		_ = a.buf.flush()
		// Busy: drain every batchEvery until a period brings nothing.
		for {
			timer.Reset(batchEvery)
			<-timer.C
			if len(a.queue) == 0 {
				break
			}
			for drained := false; !drained; {
				select {
				case it, ok := <-a.queue:
					if !ok {
						_ = a.buf.flush()
						return
					}
					a.write(it, &fields)
				default:
					drained = true
				}
			}
			_ = a.buf.flush()
		}
	}
}

// write renders one record, or answers a Flush marker.
func (a *AccessLog) write(it accessItem, fields *[]zap.Field) {
	if it.flush != nil {
		_ = a.log.Sync()
		close(it.flush)
		return
	}
	*fields = appendFields((*fields)[:0], &it.rec)
	a.log.Info("", *fields...)
}

// bufferedSyncer batches the access log's writes. Only the writer
// goroutine touches it.
type bufferedSyncer struct {
	w  *bufio.Writer
	ws zapcore.WriteSyncer
}

func (b *bufferedSyncer) Write(p []byte) (int, error) { return b.w.Write(p) }

func (b *bufferedSyncer) flush() error { return b.w.Flush() }

func (b *bufferedSyncer) Sync() error {
	if err := b.w.Flush(); err != nil {
		return err
	}
	return b.ws.Sync()
}

// appendFields renders r with the access log's field names. Timings that
// did not happen are left out, not written as zero.
func appendFields(f []zap.Field, r *Record) []zap.Field {
	ms := func(name string, d time.Duration) {
		if d >= 0 {
			f = append(f, zap.Float64(name, float64(d.Microseconds())/1000))
		}
	}
	f = append(f,
		zap.String("request_id", r.RequestID),
		zap.String("route", r.Route),
		zap.String("model", r.Model),
		zap.String("tenant", r.Tenant),
		zap.String("method", r.Method),
		zap.String("path", r.Path),
		zap.Int("status", r.Status),
		zap.String("outcome", string(r.Outcome)),
		zap.Bool("stream", r.Stream),
	)
	ms("queue_ms", r.Queue)
	ms("upstream_ttfb_ms", r.UpstreamTTFB)
	ms("ttft_ms", r.TTFT)
	ms("ttfa_ms", r.TTFA)
	if r.ITLCount > 0 {
		ms("itl_mean_ms", r.ITLMean)
		ms("itl_p50_ms", r.ITLP50)
		ms("itl_p99_ms", r.ITLP99)
		ms("itl_max_ms", r.ITLMax)
	}
	ms("tpot_ms", r.TPOT)
	ms("e2e_ms", r.E2E)
	ms("overhead_ms", r.Overhead)
	ms("client_rtt_ms", r.ClientRTT)
	ms("server_queue_ms", r.ServerQueue)
	ms("server_load_ms", r.ServerLoad)
	ms("server_prefill_ms", r.ServerPrefill)
	ms("server_decode_ms", r.ServerDecode)
	f = append(f,
		zap.Int("output_tokens", r.OutputTokens),
		zap.Int("input_tokens", r.InputTokens),
		zap.String("tokens_source", r.TokensSource),
		zap.Int("events", r.Events),
		zap.Int64("bytes_in", r.BytesIn),
		zap.Int64("bytes_out", r.BytesOut),
	)
	if r.Items > 0 {
		f = append(f, zap.Int("items", r.Items))
		if r.E2E > 0 {
			f = append(f, zap.Float64("items_per_s", float64(r.Items)/r.E2E.Seconds()))
		}
	}
	if r.Dialect != "" {
		f = append(f, zap.String("dialect", r.Dialect))
	}
	if r.Partial {
		f = append(f, zap.Bool("partial", true))
	}
	if r.Error != "" {
		f = append(f, zap.String("error", r.Error))
	}
	return f
}
