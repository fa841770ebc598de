package metrics

import (
	"bytes"
	"errors"
	"os"
	"runtime"
	"sync"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics/internal/inbox"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

var (
	accessLogDropped     = vm.NewCounter("tokentap_access_log_dropped_total")
	accessLogWriteErrors = vm.NewCounter("tokentap_access_log_write_errors_total")
	accessLogReopens     = vm.NewCounter("tokentap_access_log_reopens_total")
)

// AccessLog writes one JSON line per record through zap, from a goroutine of
// its own: Observe only copies the record into a bounded queue, so a slow
// or full disk never blocks the relay. When the queue is full the record is
// dropped and tokentap_access_log_dropped_total counts it.
//
// A failed write (a full disk, an I/O error) is counted in
// tokentap_access_log_write_errors_total and retried, from where it
// stopped, after a pause that doubles from 50 ms to 5 s; lines written
// meanwhile wait, up to 16 MiB of them (past that a line is dropped and
// counted), so a disk that fills up and is freed loses no line. Reopen
// starts a new file after a rotation (logrotate's rename) with no line lost.
//
// Observe, Flush and Reopen are safe for concurrent use, also after Close
// (a record observed after Close is counted as dropped). Call Close to
// write what is queued and stop.
type AccessLog struct {
	out  *logOutput // the writer goroutine's only
	log  *zap.Logger
	box  *inbox.Box[accessItem] // the queue (inbox's doc says why not a channel)
	done chan struct{}
	once sync.Once
}

type accessItem struct {
	rec    Record
	flush  chan struct{} // non-nil: a Flush marker, not a record
	reopen chan error    // non-nil: a Reopen marker
}

// NewAccessLog starts an access log writing to w. queueLen <= 0 means 8192.
// Reopen on it does nothing.
func NewAccessLog(w zapcore.WriteSyncer, queueLen int) *AccessLog {
	return newAccessLog(&logOutput{ws: w}, queueLen)
}

// OpenAccessLog starts an access log appending to the file at path ("-" is
// standard output), which Reopen opens again by name. queueLen <= 0 means
// 8192.
func OpenAccessLog(path string, queueLen int) (*AccessLog, error) {
	if path == "-" {
		return NewAccessLog(zapcore.Lock(os.Stdout), queueLen), nil
	}
	open := func() (zapcore.WriteSyncer, func() error, error) {
		f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			return nil, nil, err
		}
		return f, f.Close, nil
	}
	ws, closeFn, err := open()
	if err != nil {
		return nil, err
	}
	return newAccessLog(&logOutput{ws: ws, closeFn: closeFn, open: open}, queueLen), nil
}

func newAccessLog(out *logOutput, queueLen int) *AccessLog {
	if queueLen <= 0 {
		queueLen = 8192
	}
	enc := zapcore.NewJSONEncoder(zapcore.EncoderConfig{
		TimeKey:        "ts",
		EncodeTime:     zapcore.RFC3339NanoTimeEncoder,
		LineEnding:     zapcore.DefaultLineEnding,
		EncodeDuration: zapcore.StringDurationEncoder,
	})
	a := &AccessLog{
		out:  out,
		log:  zap.New(zapcore.NewCore(enc, out, zapcore.InfoLevel)),
		box:  inbox.New[accessItem](queueLen, 1),
		done: make(chan struct{}),
	}
	go a.run()
	return a
}

// Observe queues r for writing. It never blocks.
func (a *AccessLog) Observe(r *Record) {
	if !a.box.Put(true, func(it *accessItem) { it.rec = *r }) {
		accessLogDropped.Inc()
	}
}

// send queues a marker, after the records queued before it (markers are
// few, and always taken); false after Close.
func (a *AccessLog) send(m accessItem) bool {
	return a.box.Put(false, func(it *accessItem) { *it = m })
}

// Flush waits until every record queued before the call was handed to the
// output (written, or waiting for a failed write's retry).
func (a *AccessLog) Flush() {
	ch := make(chan struct{})
	if a.send(accessItem{flush: ch}) {
		<-ch
	}
}

// Reopen closes the log file and opens it again by its name, after the
// records queued before the call were written to the old one: the way to
// follow a rotation that renamed the file. It does nothing for standard
// output or a writer given to NewAccessLog. On an error the old file stays
// in use.
func (a *AccessLog) Reopen() error {
	ch := make(chan error, 1)
	if !a.send(accessItem{reopen: ch}) {
		return errors.New("access log closed")
	}
	return <-ch
}

// Close writes what is queued (retrying a failing output for up to 2 s,
// then counting what is left as dropped) and stops the writer.
func (a *AccessLog) Close() {
	a.once.Do(func() {
		a.box.Close()
		<-a.done
	})
}

// batchEvery is how often the writer drains the queue while records keep
// coming. Between drains records queue up without waking it; when they stop
// coming it waits for the next, so an idle proxy has no timer running
// (unless a failed write waits for its retry). Each wake-up costs the
// process a few context switches whatever it drains: at 1,000 requests/s
// on one core, drains every 5 ms cost 20–30 µs of CPU per request, every
// 50 ms a few µs. A crash loses the lines of the last period at most.
const batchEvery = 50 * time.Millisecond

// yieldEvery is the lines rendered between two yields of the writer's
// goroutine: an execution trace at 381 requests/s on one CPU showed each
// period's drain (19 lines and their write) on the CPU for 115–233 µs at
// once, the requests that arrived meanwhile waiting for it; yielding
// every 4 lines bounds that wait to about one line's rendering.
const yieldEvery = 4

func (a *AccessLog) run() {
	defer close(a.done)
	fields := make([]zap.Field, 0, 40)
	timer := time.NewTimer(batchEvery)
	timer.Stop()
	lines := 0
	for {
		// Idle: wait for a record (or a failed write's retry).
		if a.out.waiting() {
			timer.Reset(time.Until(a.out.retryAt))
			select {
			case <-a.box.Wake:
				timer.Stop()
			case <-timer.C:
				a.out.flush()
				continue
			}
		} else {
			<-a.box.Wake
		}
		// Write what came at once, then every batchEvery until a period
		// brings nothing.
		for {
			n, closed := a.box.Drain(func(it *accessItem) {
				if lines++; lines%yieldEvery == 0 {
					// Let requests run between lines: on one CPU a
					// period's drain would hold it for its whole length.
					runtime.Gosched()
				}
				a.handle(it, &fields)
			})
			a.out.flush()
			if closed {
				a.out.final()
				return
			}
			if n == 0 {
				break
			}
			timer.Reset(batchEvery)
			<-timer.C
		}
	}
}

// handle renders one record, or answers a marker.
func (a *AccessLog) handle(it *accessItem, fields *[]zap.Field) {
	switch {
	case it.flush != nil:
		a.out.flush()
		_ = a.out.ws.Sync()
		close(it.flush)
	case it.reopen != nil:
		it.reopen <- a.out.reopen()
	default:
		*fields = appendFields((*fields)[:0], &it.rec)
		a.log.Info("", *fields...)
	}
}

// maxPending bounds the rendered lines waiting for the output.
const maxPending = 16 << 20

// logOutput holds rendered lines until the output takes them. Only the
// writer goroutine touches it.
type logOutput struct {
	ws      zapcore.WriteSyncer
	closeFn func() error                                      // nil: nothing to close
	open    func() (zapcore.WriteSyncer, func() error, error) // nil: cannot reopen

	pend    []byte // lines not yet written; pend[off:] is what is left
	off     int
	backoff time.Duration // zero while the output works
	retryAt time.Time
}

// Write takes one rendered line (zap writes each entry in one call).
func (o *logOutput) Write(p []byte) (int, error) {
	if len(o.pend)-o.off+len(p) > maxPending {
		accessLogDropped.Inc()
		return len(p), nil
	}
	o.pend = append(o.pend, p...)
	return len(p), nil
}

// Sync is a no-op: the writer goroutine decides when lines go out.
func (o *logOutput) Sync() error { return nil }

// waiting reports lines held back by a failed write.
func (o *logOutput) waiting() bool { return o.backoff > 0 && o.off < len(o.pend) }

// flush writes what is pending, unless a failed write's retry is not due.
func (o *logOutput) flush() {
	if o.backoff > 0 && time.Now().Before(o.retryAt) {
		return
	}
	for o.off < len(o.pend) {
		n, err := o.ws.Write(o.pend[o.off:])
		o.off += n
		if err != nil {
			accessLogWriteErrors.Inc()
			o.backoff = min(max(2*o.backoff, 50*time.Millisecond), 5*time.Second)
			o.retryAt = time.Now().Add(o.backoff)
			return
		}
	}
	o.pend, o.off, o.backoff = o.pend[:0], 0, 0
	if cap(o.pend) > 1<<20 {
		o.pend = nil // a backlog's buffer is not kept
	}
}

// reopen writes what it can to the old file and switches to a new one;
// what the old one refused goes to the new one.
func (o *logOutput) reopen() error {
	if o.open == nil {
		return nil
	}
	o.backoff = 0
	o.flush()
	ws, closeFn, err := o.open()
	if err != nil {
		accessLogWriteErrors.Inc()
		return err
	}
	_ = o.ws.Sync()
	if o.closeFn != nil {
		_ = o.closeFn()
	}
	o.ws, o.closeFn, o.backoff = ws, closeFn, 0
	accessLogReopens.Inc()
	o.flush()
	return nil
}

// final writes what is left, retrying a failing output for up to 2 s; the
// lines it could not write are counted as dropped.
func (o *logOutput) final() {
	deadline := time.Now().Add(2 * time.Second)
	for {
		o.backoff = 0
		o.flush()
		if o.off == len(o.pend) || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if left := o.pend[o.off:]; len(left) > 0 {
		accessLogDropped.Add(bytes.Count(left, []byte{'\n'}))
	}
	_ = o.ws.Sync()
	if o.closeFn != nil {
		_ = o.closeFn()
	}
}

// appendFields renders r with the access log's field names. Timings that
// did not happen are left out, not written as zero.
func appendFields(f []zap.Field, r *Record) []zap.Field {
	f = append(f,
		zap.String("request_id", r.RequestID),
		zap.String("route", r.Route),
	)
	if r.Upstream != "" {
		f = append(f, zap.String("upstream", r.Upstream))
	}
	if r.Shadow {
		f = append(f, zap.Bool("shadow", true))
	}
	f = append(f,
		zap.String("model", r.Model),
		zap.String("tenant", r.Tenant),
		zap.String("method", r.Method),
		zap.String("client_protocol", r.ClientProtocol),
		zap.String("path", r.Path),
		zap.Int("status", r.Status),
		zap.String("outcome", string(r.Outcome)),
		zap.Bool("stream", r.Stream),
	)
	f = appendTimings(f, r)
	return appendCounts(f, r)
}

// appendMS adds d in milliseconds as name, when it was measured (d >= 0).
func appendMS(f []zap.Field, name string, d time.Duration) []zap.Field {
	if d >= 0 {
		f = append(f, zap.Float64(name, float64(d.Microseconds())/1000))
	}
	return f
}

// appendTimings adds r's times (those measured: each at or above 0) and
// its priority, in the log's order.
func appendTimings(f []zap.Field, r *Record) []zap.Field {
	ms := func(name string, d time.Duration) { f = appendMS(f, name, d) }
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
	ms("request_upload_ms", r.Upload)
	ms("client_rtt_ms", r.ClientRTT)
	ms("client_srtt_ms", r.ClientSRTT)
	ms("client_ttft_ms", r.ClientTTFT)
	ms("client_ttfa_ms", r.ClientTTFA)
	ms("client_e2e_ms", r.ClientE2E)
	if r.ClientStall > 0 {
		ms("client_stall_ms", r.ClientStall)
	}
	if rd := &r.Reading; rd.Tokens > 0 {
		f = append(f, zap.Float64("qoe", rd.QoE), zap.Float64("fluidity", rd.Fluidity),
			zap.Float64("stall_ms", float64(rd.Stall.Microseconds())/1000), zap.Int("stalls", rd.Stalls))
		if rd.HeldBy != HopNone {
			f = append(f, zap.String("held_by", rd.HeldBy.String()))
		}
	}
	ms("server_queue_ms", r.ServerQueue)
	ms("server_load_ms", r.ServerLoad)
	ms("server_prefill_ms", r.ServerPrefill)
	ms("server_decode_ms", r.ServerDecode)
	ms("server_ttft_ms", r.ServerTTFT)
	if r.Priority != "" {
		f = append(f, zap.String("priority", r.Priority))
	}
	ms("predicted_ttft_ms", r.Predicted.TTFT)
	ms("predicted_tpot_ms", r.Predicted.TPOT)
	return f
}

// appendCounts adds r's tokens, bytes, cost and what else it says, in the
// log's order.
func appendCounts(f []zap.Field, r *Record) []zap.Field {
	f = append(f,
		zap.Int("output_tokens", r.OutputTokens),
		zap.Int("input_tokens", r.InputTokens),
		zap.String("tokens_source", r.TokensSource),
		zap.Int("events", r.Events),
		zap.Int64("bytes_in", r.BytesIn),
		zap.Int64("bytes_out", r.BytesOut),
	)
	if r.CachedTokens >= 0 {
		f = append(f, zap.Int("cached_tokens", r.CachedTokens))
	}
	if r.UsageSource != "" {
		f = append(f, zap.Int("cache_write_tokens", r.CacheWriteTokens), zap.String("usage_source", r.UsageSource))
	}
	if r.Cost.USD >= 0 {
		f = append(f, zap.Float64("cost_usd", r.Cost.USD))
	}
	if r.Cost.Basis != "" {
		f = append(f, zap.String("cost_basis", r.Cost.Basis))
	}
	if r.ReasoningTokens >= 0 {
		f = append(f, zap.Int("reasoning_tokens", r.ReasoningTokens))
	}
	if r.Class != "" {
		f = append(f, zap.String("class", r.Class))
	}
	if r.BytesWire > 0 {
		f = append(f, zap.Int64("bytes_wire", r.BytesWire))
	}
	if r.BytesAcked >= 0 {
		f = append(f, zap.Int64("bytes_acked", r.BytesAcked))
	}
	if r.Unacked {
		f = append(f, zap.Bool("unacked", true))
	}
	if r.Attempts > 1 {
		f = append(f, zap.Int("attempts", r.Attempts))
	}
	f = appendMS(f, "failover_ms", r.FailoverWait)
	if r.ClientRetrans > 0 {
		f = append(f, zap.Int("client_retrans", r.ClientRetrans))
	}
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
	if r.SLOJudged {
		f = append(f, zap.Bool("slo_ok", r.SLOMisses == 0), zap.Strings("slo_missed", r.sloMissedList()))
	}
	return f
}

// sloMissedList names the missed objectives (an empty list for a good
// request).
func (r *Record) sloMissedList() []string {
	out := []string{}
	for i, n := range SLONames {
		if r.SLOMisses.Has(i) {
			out = append(out, n)
		}
	}
	return out
}
