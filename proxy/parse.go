package proxy

import (
	"bytes"
	"time"

	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// startParsing chooses how the body is measured from its Content-Type and
// Content-Encoding.
func (x *exchange) startParsing(resp *fasthttp.Response) {
	ct := resp.Header.ContentType()
	if i := bytes.IndexByte(ct, ';'); i >= 0 {
		ct = ct[:i]
	}
	ct = bytes.TrimSpace(ct)
	switch {
	case bytes.EqualFold(ct, []byte("text/event-stream")):
		x.streamed, x.mode = true, parseSSE
	case bytes.EqualFold(ct, []byte("application/x-ndjson")), bytes.EqualFold(ct, []byte("application/jsonl")),
		bytes.EqualFold(ct, []byte("application/json-seq")):
		x.streamed, x.mode = true, parseLines
	default:
		x.mode = parseBody
	}
	x.rec.Stream = x.streamed
	if enc := resp.Header.ContentEncoding(); len(enc) > 0 && !bytes.EqualFold(enc, []byte("identity")) {
		// The compressed bytes pass through untouched; the parser reads a
		// decompressed copy.
		if x.dec = newSideDecoder(enc, x.snap.cfg.MaxDecodedBytes); x.dec == nil {
			x.mode = parseNone
			x.rec.Partial = true
		}
	}
	if x.strip && (x.mode != parseSSE || x.dec != nil) {
		x.strip = false // only a plain SSE stream can have the chunk removed
	}
	max := x.snap.cfg.MaxEventBytes
	switch x.mode {
	case parseSSE:
		if x.parser == nil {
			x.parser = sse.NewParser(max)
		}
		x.parser.Reset()
	case parseLines:
		if x.lines == nil {
			x.lines = sse.NewLines(max)
		}
		x.lines.Reset()
	}
}

// observe feeds one upstream read, read at t, to the parser (through the
// decompressor when the body is compressed).
func (x *exchange) observe(b []byte, t time.Time) {
	x.m.read(t)
	if x.dec != nil {
		// What was decoded of earlier chunks is measured first, with their
		// own times; this chunk's events are measured once decoded.
		x.takeDecoded()
		x.dec.feed(b)
		x.decTimes = append(x.decTimes, chunkTimes{read: t})
		return
	}
	x.parse(b, t)
}

// chunkTimes are when a compressed chunk was read and delivered.
type chunkTimes struct{ read, flush time.Time }

// takeDecoded parses what the side decoder produced since the last call,
// each part stamped with the read and delivery times of the chunk it came
// in. Tokens of a chunk that was never delivered (the client write failed)
// are counted as events but not as delivered.
func (x *exchange) takeDecoded() {
	parts := x.dec.take()
	for _, part := range parts {
		ct := x.decTimes[part.seq-x.decBase]
		x.parse(part.b, ct.read)
		if ct.flush.IsZero() {
			x.m.drop()
			continue
		}
		x.m.deliver(ct.flush)
	}
	if n := len(parts); n > 0 {
		// Later parts come from this chunk or later ones.
		keep := parts[n-1].seq - x.decBase
		x.decTimes = append(x.decTimes[:0], x.decTimes[keep:]...)
		x.decBase += keep
	}
}

// parse reads body bytes read at t.
func (x *exchange) parse(b []byte, t time.Time) {
	switch x.mode {
	case parseSSE:
		if x.strip {
			x.parseStrip(b, t)
			return
		}
		x.parser.Feed(b)
		for x.parser.Next() {
			ev := x.parser.Event()
			if ev.Truncated {
				x.rec.Partial = true
			}
			x.m.observe(x.dialect.Event(ev.Type, ev.Data), t)
		}
	case parseLines:
		x.lines.Feed(b)
		for x.lines.Next() {
			if x.lines.Truncated() {
				x.rec.Partial = true
			}
			x.m.observe(x.dialect.Event(nil, x.lines.Line()), t)
		}
	case parseBody:
		if len(x.whole)+len(b) <= x.snap.cfg.MaxEventBytes {
			x.whole = append(x.whole, b...)
		} else {
			x.rec.Partial = true
			x.mode = parseNone
		}
	}
}

// parseStrip parses like parse and also leaves in x.stripped the bytes to
// relay: everything but the usage-only chunk that tokentap itself asked for
// (stream_options.include_usage injected into the request). Bytes of an
// event still incomplete are held back until it completes, so an event is
// relayed in the write of the read that completed it, as without stripping.
func (x *exchange) parseStrip(b []byte, t time.Time) {
	out := x.stripped[:0]
	start := 0
	x.parser.Feed(b)
	for x.parser.Next() {
		end := x.parser.Offset()
		ev := x.parser.Event()
		if ev.Truncated {
			x.rec.Partial = true
		}
		x.m.observe(x.dialect.Event(ev.Type, ev.Data), t)
		if !dialect.UsageOnly(ev.Data) {
			out = append(out, x.held...)
			out = append(out, b[start:end]...)
		}
		x.held = x.held[:0]
		start = end
	}
	rest := b[start:]
	switch {
	case !x.parser.Pending():
		// Between events (comments, blank lines): nothing to decide later.
		out = append(out, x.held...)
		out = append(out, rest...)
		x.held = x.held[:0]
	case len(x.held)+len(rest) > x.snap.cfg.MaxEventBytes:
		// An event too large to hold: stop stripping, relay as it comes.
		out = append(out, x.held...)
		out = append(out, rest...)
		x.held = x.held[:0]
		x.strip = false
	default:
		x.held = append(x.held, rest...)
	}
	x.stripped = out
}
