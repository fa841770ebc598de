package measure

import (
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/sse/dialect"
)

// What the request path tells the tap of a request before its response,
// and what it reads of it at the end. None of it does I/O or reads a
// clock: every time is given.

// MaxModel is the longest model name a record keeps.
const MaxModel = 128

// Begin readies the tap for a request that began to arrive at arrival.
func (tp *Tap) Begin(arrival time.Time) { tp.m.reset(arrival) }

// Trace has the tap read the response's model and finish reason too (the
// request is traced).
func (tp *Tap) Trace() { tp.details = true }

// Details reports whether the tap reads the response's model and finish
// reason (Trace).
func (tp *Tap) Details() bool { return tp.details }

// Arrival is when the request began to arrive.
func (tp *Tap) Arrival() time.Time { return tp.m.arrival }

// Uploaded notes when the request's last bytes arrived (last): a request
// whose bytes came in over time kept tokentap waiting for the client.
func (tp *Tap) Uploaded(last time.Time) {
	if last.After(tp.m.arrival) {
		tp.m.upload = last.Sub(tp.m.arrival)
	}
}

// Items notes how many items (inputs to embed, say) the request holds.
func (tp *Tap) Items(n int) { tp.m.items = n }

// Live has every inter-token gap go to s as it is measured (nil: none).
func (tp *Tap) Live(s *metrics.Series) { tp.m.live = s }

// Sent notes when the request was written upstream (the last attempt's).
func (tp *Tap) Sent(t time.Time) { tp.m.written = t }

// Written is when the request was written upstream (zero: not yet).
func (tp *Tap) Written() time.Time { return tp.m.written }

// Lost adds d spent on an attempt that failed over: the backends' time,
// not tokentap's.
func (tp *Tap) Lost(d time.Duration) { tp.m.lost += d }

// Ended marks the end of a response that delivered nothing measured (a
// tunnel's close) at t.
func (tp *Tap) Ended(t time.Time) { tp.m.lastFlush = t }

// Timings notes the server's own timings, from its response header.
func (tp *Tap) Timings(t dialect.Timings) { tp.m.timings = t }

// Strip asks (on) that the usage-only chunk tokentap asked the upstream
// for be dropped from what the client receives, or no longer (a failover
// to an upstream that was not asked). Start keeps it only for a plain SSE
// stream.
func (tp *Tap) Strip(on bool) { tp.strip = on }

// Stripping reports whether the next read's bytes are relayed stripped
// (Stripped): it may stop during a read, whose bytes still are.
func (tp *Tap) Stripping() bool { return tp.strip }

// Stripped is what to relay of the read of n bytes just fed to Read,
// while Stripping: its bytes without the usage chunk, with an event not
// yet complete held back until it completes, and, at the body's end, what
// was held.
func (tp *Tap) Stripped(n int, end bool) []byte {
	if n == 0 {
		tp.stripped = tp.stripped[:0]
	}
	out := tp.stripped
	if end {
		out = append(out, tp.held...)
		tp.held = tp.held[:0]
	}
	return out
}

// Streamed reports a stream (SSE or NDJSON), measured event by event.
func (tp *Tap) Streamed() bool { return tp.streamed }

// Decoding reports a compressed body measured through its side decoder.
func (tp *Tap) Decoding() bool { return tp.dec != nil }

// FirstByteRead and FirstTokenRead are when the body's first byte and its
// first token event reached tokentap's kernel (zero: not yet).
func (tp *Tap) FirstByteRead() time.Time  { return tp.m.firstByteRead }
func (tp *Tap) FirstTokenRead() time.Time { return tp.m.firstTokenRead }

// StreamError reports an error told inside the response.
func (tp *Tap) StreamError() bool { return tp.m.streamError }

// Model is the model the response named (empty: none read).
func (tp *Tap) Model() []byte { return tp.model }

// Gaps are the inter-token gaps kept for the record.
func (tp *Tap) Gaps() []time.Duration { return tp.m.gaps }

// Events is the token events observed so far.
func (tp *Tap) Events() int { return tp.m.events }

// Grown gives the tap the room a pooled exchange's tap keeps after long
// streams (every gap a record keeps), so that a measure of the steady
// state (the relay's benchmarks) does not count that room's growth.
func (tp *Tap) Grown() {
	if cap(tp.m.gaps) < maxGaps {
		tp.m.gaps = make([]time.Duration, 0, maxGaps)
	}
}

// InputTokens is the request's input tokens: the usage's where the
// backend said, else the estimate from its body's bytesIn.
func (tp *Tap) InputTokens(bytesIn int64) int { return tp.m.usage.input(bytesIn) }

// UsageReported reports that the backend gave a usage (input or output).
func (tp *Tap) UsageReported() bool { return tp.m.usage.hasIn || tp.m.usage.hasOut }

// Used is what the request used, for its admission ticket: its tokens (the
// usage's, else its input estimated from bytesIn and the output tokens
// counted) and their cost under c.
func (tp *Tap) Used(bytesIn int64, c Charge) (tokens int64, usd float64) {
	out, _ := tp.m.outputTokens(tp.streamed)
	return int64(tp.m.usage.input(bytesIn) + out), c.used(&tp.m.usage, bytesIn, out)
}

// CheckUsage sets aside a usage that could not be true of a request of
// bytesIn body bytes (bodyEncoded: compressed) whose response carried
// bytesOut bytes and ended at now (usage.plausible): no response moves a
// count, a bill or a budget by more than it could have cost.
func (tp *Tap) CheckUsage(bytesIn int64, bodyEncoded bool, bytesOut int64, now time.Time) {
	u := &tp.m.usage
	if !u.bad && !u.hasIn && !u.hasOut {
		return
	}
	if bodyEncoded {
		bytesIn *= compressedRatio
	}
	if !u.plausible(bytesIn, tp.Text(bytesOut), now.Sub(tp.m.arrival)) {
		u.reject()
	}
}

// Fill fills rec with what the tap measured (meter.fill: timings, counts
// and usage), the request's start, whether what was measured was partial,
// and the response's model and finish reason. now ends a response that
// delivered nothing; rec.Queue must be set.
func (tp *Tap) Fill(rec *metrics.Record, now time.Time) {
	rec.Partial = rec.Partial || tp.partial
	tp.m.fill(rec, now, tp.streamed)
	rec.Start = tp.m.arrival
	if tp.details {
		rec.FinishReason = tp.finish
	}
	if len(tp.model) > 0 {
		rec.ResponseModel = string(tp.model)
	}
}

// Pace sets what the stream is read against (its zero times: DefaultPace's).
// Before the body's first token.
func (tp *Tap) Pace(p Pace) { tp.m.rd.start(p) }

// FillReading fills, once the client's side of rec is filled (its time to
// first token), how the stream read (rec.Reading) and the inter-token
// gaps' percentiles.
func (tp *Tap) FillReading(rec *metrics.Record) { tp.m.finish(rec, tp.streamed) }
