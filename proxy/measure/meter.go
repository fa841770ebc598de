package measure

import (
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/sse/dialect"
)

// meter is the measuring state of one exchange: clock marks, token events,
// the gaps between them, usage and server timings. It does no I/O and reads
// no clock: every method is given the time of what it records, so its rules
// are tested with made-up timestamps (meter_test.go), and the dialect
// fixtures run through it.
//
// The relay drives it in this order: arrived, then sent, then for each
// chunk read (the kernel's receive time) and the observations parsed from
// it (observe), then wrote once the chunk was written to the client; fill
// at the end.
type meter struct {
	arrival, written                time.Time
	lost                            time.Duration // on attempts that failed over
	upload                          time.Duration // the request's first byte → its last, as the kernel received them
	firstByteRead, firstByteFlush   time.Time
	firstTokenRead, firstTokenFlush time.Time
	firstAnswerFlush                time.Time
	lastTokenFlush, lastFlush       time.Time

	// stall is how long writes had waited for the client when the
	// delivery being stamped went out (the exchange sets it before
	// wrote or deliver); stallTTFT is its value at the first token.
	stall, stallTTFT time.Duration

	chunkTokens  int // token events observed and not yet delivered
	chunkAnswers int // of which answers
	gaps         []time.Duration
	itlCount     int
	events       int // token events
	answers      int // answer token events
	usage        usage
	items        int
	timings      dialect.Timings
	streamError  bool

	// live receives every inter-token gap as it is measured (nil: none).
	live *metrics.Series
	// rd follows the stream as a reader at the route's pace would read it.
	rd reader
}

// usage is the token usage the response reported, merged across events.
// bad: a count that cannot be true was given (dialect.Obs.BadUsage);
// rejected: the whole usage was set aside (reject), the counts tokentap
// made stand in.
type usage struct {
	hasIn, hasOut, hasCached, hasWrite, hasReasoning bool
	bad, rejected                                    bool
	in, out, cached, write, reasoning                int
}

// What a response's usage can claim beyond what tokentap saw of it
// (plausible): input tokens beyond one a byte of the request's body
// (content a request references by URL: images, files), output tokens
// beyond one a byte of the response's text (tokens a backend generates
// unseen: hidden reasoning) at the fastest rate a stream is decoded, and
// a margin for the few tokens that print nothing (an end of sequence).
const (
	unseenInput       = 1 << 17 // tokens
	unseenOutputRate  = 10_000  // tokens a second
	unseenOutputSlack = 64      // tokens
	// compressedRatio stands in for a compressed body's text where it was
	// not decoded whole: the bytes it may hold per byte sent.
	compressedRatio = 1024
)

// plausible reports whether the usage could be true of a request of
// bytesIn body bytes whose response carried textOut bytes of text and
// lasted e2e: no count given that cannot be true (bad), none past what
// the bytes and the time could carry, no part larger than its whole.
func (u *usage) plausible(bytesIn, textOut int64, e2e time.Duration) bool {
	switch {
	case u.bad:
		return false
	case u.hasIn && int64(u.in) > bytesIn+unseenInput:
		return false
	case u.hasOut && float64(u.out) > float64(textOut+unseenOutputSlack)+unseenOutputRate*max(e2e.Seconds(), 0):
		return false
	case u.hasIn && (u.cached > u.in || u.write > u.in || u.cached+u.write > u.in):
		return false
	case u.hasOut && u.hasReasoning && u.reasoning > u.out:
		return false
	}
	return true
}

// reject sets the usage aside: the record, the bill and the budgets then
// go by what tokentap counted and estimated.
func (u *usage) reject() { *u = usage{bad: u.bad, rejected: true} }

// input is the request's input tokens: the usage's where the backend
// said, else the estimate from the body's bytesIn (admission control's).
func (u *usage) input(bytesIn int64) int {
	if u.hasIn {
		return u.in
	}
	return int(bytesIn / 4)
}

// maxGaps bounds the inter-token gaps kept per request for its ITL
// percentiles (every gap still goes to the live histogram).
const maxGaps = 1 << 16

// reset readies the meter for a request that arrived at arrival, keeping
// its gap buffer.
func (m *meter) reset(arrival time.Time) {
	*m = meter{arrival: arrival, gaps: m.gaps[:0]}
	m.rd.start(Pace{})
}

// read marks a chunk of the body read at t.
func (m *meter) read(t time.Time) {
	if m.firstByteRead.IsZero() {
		m.firstByteRead = t
	}
}

// observe merges one observation of an event read at t. Its tokens count
// as delivered at the next wrote (or deliver).
func (m *meter) observe(o dialect.Obs, t time.Time) {
	if o.Token {
		m.rd.read(t, m.chunkTokens)
		m.events++
		m.chunkTokens++
		if o.Answer {
			m.answers++
			m.chunkAnswers++
		}
		if m.firstTokenRead.IsZero() {
			m.firstTokenRead = t
		}
	}
	if o.HasIn {
		m.usage.hasIn, m.usage.in = true, o.In
	}
	if o.HasOut {
		m.usage.hasOut, m.usage.out = true, o.Out
	}
	if o.HasCached {
		m.usage.hasCached, m.usage.cached = true, o.Cached
	}
	if o.HasCacheWrite {
		m.usage.hasWrite, m.usage.write = true, o.CacheWrite
	}
	if o.HasReasoning {
		m.usage.hasReasoning, m.usage.reasoning = true, o.Reasoning
	}
	if o.BadUsage {
		m.usage.bad = true
	}
	if o.Items > 0 {
		m.items = o.Items
	}
	if o.Timings.Set {
		m.timings = o.Timings
	}
	if o.Error {
		m.streamError = true
	}
}

// wrote marks a chunk written to the client at t, and the delivery of
// the token events observed since the last delivery (see deliver for
// what it reports).
func (m *meter) wrote(t time.Time) (firstToken, firstAnswer bool) {
	m.lastFlush = t
	if m.firstByteFlush.IsZero() {
		m.firstByteFlush = t
	}
	return m.deliver(t)
}

// deliver stamps the delivery at t of the token events observed since the
// last delivery. Events delivered together are gaps of 0: that is what the
// client saw.
//
// It reports whether this delivery stamped the response's first token and
// its first answer token.
func (m *meter) deliver(t time.Time) (firstToken, firstAnswer bool) {
	if m.chunkAnswers > 0 && m.firstAnswerFlush.IsZero() {
		m.firstAnswerFlush, firstAnswer = t, true
	}
	m.chunkAnswers = 0
	m.rd.deliver(t, m.chunkTokens, m.stall)
	for ; m.chunkTokens > 0; m.chunkTokens-- {
		if m.firstTokenFlush.IsZero() {
			m.firstTokenFlush, m.stallTTFT, firstToken = t, m.stall, true
		} else {
			gap := t.Sub(m.lastTokenFlush)
			if len(m.gaps) < maxGaps {
				m.gaps = append(m.gaps, gap)
			}
			m.itlCount++
			if m.live != nil {
				m.live.ITL(gap)
			}
		}
		m.lastTokenFlush = t
	}
	return firstToken, firstAnswer
}

// drop forgets token events observed and never delivered (their chunk's
// write failed).
func (m *meter) drop() { m.chunkTokens, m.chunkAnswers = 0, 0 }

// outputTokens is the response's output tokens as the record gives them,
// with where they come from: the usage the backend reported, else the
// token events of a stream ("" and 0: neither).
func (m *meter) outputTokens(streamed bool) (int, string) {
	switch {
	case m.usage.hasOut:
		return m.usage.out, "usage"
	case streamed && m.events > 0:
		return m.events, "counted"
	}
	return 0, ""
}

// fill derives the record's timings and counts. now ends a response that
// delivered nothing; streamed says whether token timings apply; rec.Queue
// must be set.
//
//   - TTFT: arrival → first token event delivered; TTFA the same for the
//     first answer event (streams only).
//   - E2E: arrival → last byte delivered (or now).
//   - TPOT: (E2E − TTFT) / (output tokens − 1), from two tokens on.
//   - ITL: every gap between consecutive deliveries of token events.
//   - Overhead: (request written upstream − arrival − queue − the
//     request's own arrival time, first byte to last − attempts that
//     failed over) + (first token delivered − first token read); without
//     token events the first body chunk stands in.
func (m *meter) fill(rec *metrics.Record, now time.Time, streamed bool) {
	if m.lastFlush.IsZero() {
		rec.E2E = now.Sub(m.arrival)
	} else {
		rec.E2E = m.lastFlush.Sub(m.arrival)
	}
	rec.Events = m.events
	if m.usage.hasIn {
		rec.InputTokens = m.usage.in
	}
	if m.usage.hasCached {
		rec.CachedTokens = m.usage.cached
	}
	rec.CacheWriteTokens = m.usage.write
	if m.usage.hasReasoning {
		rec.ReasoningTokens = m.usage.reasoning
	}
	if n, source := m.outputTokens(streamed); source != "" {
		rec.OutputTokens, rec.TokensSource = n, source
	}
	switch {
	case m.usage.rejected:
		rec.UsageSource = metrics.UsageRejected
	case m.usage.hasIn || m.usage.hasOut:
		rec.UsageSource = metrics.UsageProvider
	case rec.TokensSource == "counted":
		rec.UsageSource = metrics.UsageCounted
	default:
		rec.UsageSource = metrics.UsageEstimated
	}
	rec.Items = m.items
	if t := m.timings; t.Set {
		rec.ServerQueue, rec.ServerLoad, rec.ServerPrefill, rec.ServerDecode = t.Queue, t.Load, t.Prefill, t.Decode
		rec.ServerTTFT = t.TTFT
	}
	if streamed && !m.firstAnswerFlush.IsZero() {
		rec.TTFA = m.firstAnswerFlush.Sub(m.arrival)
	}
	if streamed && !m.firstTokenFlush.IsZero() {
		rec.TTFT = m.firstTokenFlush.Sub(m.arrival)
		rec.ClientStallTTFT = m.stallTTFT
		if rec.OutputTokens > 1 {
			rec.TPOT = (rec.E2E - rec.TTFT) / time.Duration(rec.OutputTokens-1)
		}
	}
	rec.ITLCount = m.itlCount
	if !m.written.IsZero() {
		// Attempts that failed over are the backends' time, not
		// tokentap's: they are reported apart (failover_ms).
		// So is the time the request took to arrive whole (request_upload_ms).
		o := m.written.Sub(m.arrival) - max(rec.Queue, 0) - m.lost - m.upload
		if m.lost > 0 {
			rec.FailoverWait = m.lost
		}
		if m.upload > 0 {
			rec.Upload = m.upload
		}
		switch {
		case !m.firstTokenFlush.IsZero():
			o += m.firstTokenFlush.Sub(m.firstTokenRead)
		case !m.firstByteFlush.IsZero():
			o += m.firstByteFlush.Sub(m.firstByteRead)
		}
		rec.Overhead = o
	}
}

// finish fills what needs the client's side of rec filled first (its
// time to first token) and the gaps in their order: the stream's reading
// (streams only), then the gaps' percentiles, which sort them.
func (m *meter) finish(rec *metrics.Record, streamed bool) {
	if streamed && rec.TTFT >= 0 {
		m.rd.fill(&rec.Reading, either(rec.ClientTTFT, rec.TTFT), m.gaps)
	}
	if n := len(m.gaps); n > 0 {
		var sum time.Duration
		for _, g := range m.gaps {
			sum += g
		}
		slices.Sort(m.gaps)
		rec.ITLMean = sum / time.Duration(n)
		rec.ITLP50 = m.gaps[(n-1)/2]
		rec.ITLP99 = m.gaps[(n-1)*99/100]
		rec.ITLMax = m.gaps[n-1]
	}
}

// either is a unless it is absent (negative), else b.
func either(a, b time.Duration) time.Duration {
	if a >= 0 {
		return a
	}
	return b
}
