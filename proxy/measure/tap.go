// Package measure is what tokentap measures of a request on its way: the
// tap parses each upstream read into the dialect's events and stamps them
// (Tap: Read, Wrote, Fill), the client side reads the client connection's
// TCP_INFO for what the client lived (ClientSide, Acks), and requests are
// priced (Price, Charge) and sorted into classes (Classes). It does no I/O
// on the request's path and reads no clock in the tap: it is handed the
// bytes and their times. It imports nothing of the request path (a check
// in proxy's structure test keeps it so): the exchange, the relay and the
// connections feed it.
package measure

import (
	"bytes"
	"time"

	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
)

// Tap measures a response body on its way to the client: it parses each
// upstream read (through a side decoder when the body is compressed) into
// the dialect's events and feeds the meter with them, stamped with the
// times of the chunk they came in. It does no I/O and reads no clock: the
// relay hands it the bytes and the times. It also decides, for a stream
// whose usage chunk tokentap asked for, which bytes to relay (strip).
//
// Owner: the exchange's serving goroutine, or the relay loop while the
// stream is in one (passloop.go hands it over and takes it back); the
// record reads it once the body has ended.
type Tap struct {
	dialect  dialect.Dialect
	m        meter
	acks     AckMarker // told which deliveries carried the first tokens
	streamed bool      // text/event-stream or NDJSON: measured event by event
	mode     parseMode
	strip    bool // drop the usage-only chunk tokentap asked for
	// partial: what was measured is not the whole body (an event cut at
	// maxEvent, a body past it, a copy that did not decode).
	partial bool
	// details: read the response's model and finish reason too (tracing
	// is on); prices: the model alone, until one is named (requests are
	// priced as the model that served them).
	details, prices bool
	encoded         bool // the body had a Content-Encoding
	parser          *sse.Parser
	lines           *sse.Lines
	whole           []byte       // a non-streamed body, kept up to maxEvent
	dec             *sideDecoder // decompresses a copy of a compressed body
	decTimes        []chunkTimes // compressed chunks not yet decoded, from decBase on
	decBase         int
	held            []byte // strip: bytes of an event not yet complete
	stripped        []byte // strip: the bytes of the last read to relay
	maxEvent        int
	model           []byte // the response's model (details, prices): a copy, kept in its buffer across lives
	finish          string
	// parsed counts the body's text handed to the parser (decoded, for a
	// compressed body).
	parsed int64
}

// AckMarker is told which delivery carried the stream's first token (tok)
// and first answer token (ans): written at t with the client connection's
// count at sent (the exchange's MarkAcks).
type AckMarker interface {
	MarkAcks(tok, ans bool, t time.Time, sent int64)
}

type parseMode uint8

const (
	parseNone parseMode = iota
	parseSSE
	parseLines
	parseBody
)

// Kept is the tap's next life in a pooled exchange: its buffers and
// parsers, nothing measured.
func (tp *Tap) Kept() Tap {
	return Tap{parser: tp.parser, lines: tp.lines, whole: tp.whole[:0], m: meter{gaps: tp.m.gaps[:0]},
		decTimes: tp.decTimes[:0], held: tp.held[:0], stripped: tp.stripped[:0], model: tp.model[:0]}
}

// Start chooses how the body is measured from its Content-Type (ct) and
// Content-Encoding (enc), with events of at most maxEvent bytes and a
// compressed body decoded up to maxDecoded.
func (tp *Tap) Start(ct, enc []byte, d dialect.Dialect, maxEvent int, maxDecoded int64, acks AckMarker, prices bool) {
	tp.dialect, tp.maxEvent, tp.acks, tp.prices = d, maxEvent, acks, prices
	if i := bytes.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = bytes.TrimSpace(ct)
	switch {
	case bytes.EqualFold(ct, []byte("text/event-stream")):
		tp.streamed, tp.mode = true, parseSSE
	case bytes.EqualFold(ct, []byte("application/x-ndjson")), bytes.EqualFold(ct, []byte("application/jsonl")),
		bytes.EqualFold(ct, []byte("application/json-seq")):
		tp.streamed, tp.mode = true, parseLines
	default:
		tp.mode = parseBody
	}
	if tp.encoded = Encoded(enc); tp.encoded {
		// The compressed bytes pass through untouched; the parser reads a
		// decompressed copy.
		if tp.dec = newSideDecoder(enc, maxDecoded); tp.dec == nil {
			tp.mode = parseNone
			tp.partial = true
		}
	}
	if tp.strip && (tp.mode != parseSSE || tp.dec != nil) {
		tp.strip = false // only a plain SSE stream can have the chunk removed
	}
	switch tp.mode {
	case parseSSE:
		if tp.parser == nil {
			tp.parser = sse.NewParser(maxEvent)
		}
		tp.parser.Reset()
	case parseLines:
		if tp.lines == nil {
			tp.lines = sse.NewLines(maxEvent)
		}
		tp.lines.Reset()
	}
}

// Read feeds one upstream read, received at t, to the parser (through the
// decompressor when the body is compressed).
func (tp *Tap) Read(b []byte, t time.Time) {
	tp.m.read(t)
	if tp.dec != nil {
		// What was decoded of earlier chunks is measured first, with their
		// own times; this chunk's events are measured once decoded.
		tp.takeDecoded(false)
		tp.dec.feed(b)
		tp.decTimes = append(tp.decTimes, chunkTimes{read: t})
		return
	}
	tp.parse(b, t)
}

// takeDecoded parses what the side decoder produced since the last call,
// each part stamped with the read and delivery times of the chunk it came
// in. Tokens of a chunk that was never delivered (the client write failed)
// are counted as events but not as delivered.
func (tp *Tap) takeDecoded(final bool) {
	parts := tp.dec.take()
	for _, part := range parts {
		ct := tp.decTimes[part.seq-tp.decBase]
		tp.parse(part.b, ct.read)
		switch {
		case !ct.flush.IsZero():
			tp.m.stall = ct.stall
			tok, ans := tp.m.deliver(ct.flush)
			tp.acks.MarkAcks(tok, ans, ct.flush, ct.sent)
		case final:
			tp.m.drop() // its write failed: never delivered
		default:
			// Its chunk came in the read being relayed (several chunks in
			// one read) and is not written yet: its tokens are delivered
			// with that write (wrote).
		}
	}
	if n := len(parts); n > 0 {
		// Later parts come from this chunk or later ones.
		keep := parts[n-1].seq - tp.decBase
		tp.decTimes = append(tp.decTimes[:0], tp.decTimes[keep:]...)
		tp.decBase += keep
	}
}

// parse reads body bytes read at t.
func (tp *Tap) parse(b []byte, t time.Time) {
	tp.parsed += int64(len(b))
	switch tp.mode {
	case parseSSE:
		if tp.strip {
			tp.parseStrip(b, t)
			return
		}
		tp.parser.Feed(b)
		for tp.parser.Next() {
			ev := tp.parser.Event()
			if ev.Truncated {
				tp.partial = true
			}
			tp.m.observe(tp.dialect.Event(ev.Type, ev.Data), t)
			tp.readDetails(ev.Data)
		}
	case parseLines:
		tp.lines.Feed(b)
		for tp.lines.Next() {
			if tp.lines.Truncated() {
				tp.partial = true
			}
			tp.m.observe(tp.dialect.Event(nil, tp.lines.Line()), t)
			tp.readDetails(tp.lines.Line())
		}
	case parseBody:
		if len(tp.whole)+len(b) <= tp.maxEvent {
			tp.whole = append(tp.whole, b...)
		} else {
			tp.partial = true
			tp.mode = parseNone
		}
	}
}

// parseStrip parses like parse and also leaves in tp.stripped the bytes to
// relay: everything but the usage-only chunk that tokentap itself asked for
// (stream_options.include_usage injected into the request). Bytes of an
// event still incomplete are held back until it completes, so an event is
// relayed in the write of the read that completed it, as without stripping.
func (tp *Tap) parseStrip(b []byte, t time.Time) {
	out := tp.stripped[:0]
	start := 0
	tp.parser.Feed(b)
	for tp.parser.Next() {
		end := tp.parser.Offset()
		ev := tp.parser.Event()
		if ev.Truncated {
			tp.partial = true
		}
		tp.m.observe(tp.dialect.Event(ev.Type, ev.Data), t)
		tp.readDetails(ev.Data)
		if !dialect.UsageOnly(ev.Data) {
			out = append(out, tp.held...)
			out = append(out, b[start:end]...)
		}
		tp.held = tp.held[:0]
		start = end
	}
	rest := b[start:]
	switch {
	case !tp.parser.Pending():
		// Between events (comments, blank lines): nothing to decide later.
		out = append(out, tp.held...)
		out = append(out, rest...)
		tp.held = tp.held[:0]
	case len(tp.held)+len(rest) > tp.maxEvent:
		// An event too large to hold: stop stripping, relay as it comes.
		out = append(out, tp.held...)
		out = append(out, rest...)
		tp.held = tp.held[:0]
		tp.strip = false
	default:
		tp.held = append(tp.held, rest...)
	}
	tp.stripped = out
}

// Wrote stamps the delivery of a chunk written to the client at t, when
// the client connection's writes had waited stall in all and its count was
// sent; it reports whether the delivery carried the first token and the
// first answer token (meter.wrote).
func (tp *Tap) Wrote(t time.Time, stall time.Duration, sent int64) (tok, ans bool) {
	if tp.dec != nil {
		// Its tokens are stamped once decoded (takeDecoded); a read relayed
		// whole can have fed the decoder several chunks.
		for i := len(tp.decTimes) - 1; i >= 0 && tp.decTimes[i].flush.IsZero(); i-- {
			tp.decTimes[i].flush, tp.decTimes[i].stall, tp.decTimes[i].sent = t, stall, sent
		}
	}
	tp.m.stall = stall
	return tp.m.wrote(t)
}

// FirstPending reports that the response's first token was read and not
// yet delivered: the next write carries it.
func (tp *Tap) FirstPending() bool {
	return tp.m.chunkTokens > 0 && tp.m.firstTokenFlush.IsZero()
}

// Settle makes everything the body says known to the meter: what the side
// decoder has left of a compressed body (once it is done), and a complete
// body read whole (not streamed): its usage, its error.
func (tp *Tap) Settle(now time.Time, complete bool) {
	if tp.dec != nil {
		clean := tp.dec.close(func() { tp.takeDecoded(true) })
		if !clean && complete || tp.dec.over || tp.dec.dropped {
			tp.partial = true // the copy did not decode (or past a limit); the relay was unaffected
		}
		tp.dec = nil
	}
	if tp.mode == parseBody && complete && len(tp.whole) > 0 {
		o := tp.dialect.Body(tp.whole)
		o.Token, o.Answer = false, false
		tp.m.observe(o, now)
		tp.readDetails(tp.whole)
	}
	tp.whole = tp.whole[:0]
}

// Text is the bytes of text the body carried, sent as bytesOut: those
// parsed, and for a compressed body not decoded whole, what its bytes could
// hold (compressedRatio).
func (tp *Tap) Text(bytesOut int64) int64 {
	if tp.encoded && tp.partial {
		return max(tp.parsed, bytesOut*compressedRatio)
	}
	return max(tp.parsed, bytesOut)
}

// Encoded reports a Content-Encoding other than identity.
func Encoded(enc []byte) bool { return len(enc) > 0 && !bytes.EqualFold(enc, []byte("identity")) }

// readDetails reads the model that answered (until one is named) and the
// finish reason (the last one given) from an event, line or body, when
// tracing asked for them; the model alone for pricing.
func (tp *Tap) readDetails(data []byte) {
	if !tp.details && !(tp.prices && len(tp.model) == 0) {
		return
	}
	d := dialect.ReadDetails(data, len(tp.model) == 0)
	if len(d.Model) > 0 {
		tp.model = append(tp.model[:0], d.Model[:min(len(d.Model), MaxModel)]...)
	}
	if d.Finish != "" {
		tp.finish = d.Finish
	}
}
