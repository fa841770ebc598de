package proxy

import (
	"io"
	"net"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
)

// The end of an exchange: the upstream connection settled, what the client
// side and the tap measured filled into the record, the record waiting for
// the client's acknowledgement where it must, then told to the observers
// the configuration built (observe.go) and the exchange given back. And
// the delivery of each chunk on the way (Delivered, MarkAcks).

// Finish ends the exchange exactly once: it settles the upstream
// connection and stops the peer watch at once, then completes the record
// and hands it to the sinks. For a compressed response the record is
// completed on a goroutine of its own once the side decoder has decoded
// what it was given, and once the client acknowledged the response's last
// bytes (or about two round trips passed), so the end of the response
// never waits for either.
func (x *exchange) Finish(writeErr error) {
	x.live()
	if x.finished {
		return
	}
	x.finished = true
	if x.in.bodyHeld > 0 {
		// The body was sent (or never will be): out of the budget.
		x.p.bodies.Add(-x.in.bodyHeld)
		x.in.bodyHeld = 0
	}
	now := x.p.now()
	x.att.uncount()

	complete := x.relay.End(now, writeErr)
	x.watch.Stop()
	gone := x.cancel.IsGone()

	// The upstream connection goes back to the pool only after a complete,
	// clean response; anything else closes it, which also cancels the
	// request at the backend.
	if x.att.conn != nil {
		x.cancel.Detach()
		_ = x.att.resp.CloseBodyStream()
		switch {
		case x.relay.Stray():
			metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
			x.att.up.Discard(x.att.conn)
		case complete && !gone && writeErr == nil && !x.att.resp.ConnectionClose():
			x.att.up.Put(x.att.conn, x.att.resp.Header.ContentLength() < 0)
		default:
			x.att.up.Discard(x.att.conn)
		}
		x.att.conn = nil
	} else {
		// An h2c backend's body (or none): closing it resets a stream not
		// read to its end.
		_ = x.att.resp.CloseBodyStream()
	}
	wait := false
	if x.client != nil {
		ti := takeInfo(x.p)
		wait = x.cs.Ended(writeErr == nil && !gone, now, &x.p.clientAcks, !x.p.opts.NoClientSide, ti)
		x.p.infos.Put(ti)
		if cc := downstream.Of(x.client); cc != nil {
			cc.ExpectHead() // the next bytes begin the next request
		}
		x.client = nil
	}
	// The record is made later, with what finish knew now (recordEnd),
	// when it waits for the side decoder or the client's ACK.
	x.fin = finishing{now, writeErr, gone, complete}
	if x.tap.Decoding() {
		go x.recordLater(wait)
		return
	}
	x.accountBody(now, complete)
	if wait {
		x.awaitAck()
		return
	}
	x.recordEnd()
}

// recordEnd records with what finish kept in x.fin.
func (x *exchange) recordEnd() {
	e := x.fin
	x.fin = finishing{}
	x.record(e.now, e.writeErr, e.gone, e.complete)
}

// recordLater records once the side decoder is done and, with wait, the
// client acknowledged the response (or the wait ran out).
func (x *exchange) recordLater(wait bool) {
	x.accountBody(x.fin.now, x.fin.complete) // once the decoder is done, before the wait
	if wait {
		x.cs.Await(x.p.now)
	}
	x.recordEnd()
}

// record completes the record: what the body said, the outcome, the
// timings; then the sinks, and the exchange goes back to the pool.
func (x *exchange) record(now time.Time, writeErr error, gone, complete bool) {
	rec := &x.rec
	// Everything the body says is known (accountBody) before the outcome
	// is decided.

	// The outcome, upstream faults before client faults. Error texts are
	// tokentap's words: no address, no upstream bytes.
	switch {
	case rec.Outcome != metrics.OutcomeOK:
		// Set by refuse.
	case x.p.cutting.Load() && (gone || writeErr != nil || !complete):
		rec.Outcome, rec.Error = metrics.OutcomeShutdown, "cut at shutdown: the drain timeout ran out"
	case gone:
		rec.Outcome, rec.Error = metrics.OutcomeClientCancel, "client closed the connection"
	case x.relay.ReadErr() != nil && x.relay.ReadErr() != io.EOF:
		if sock.IsTimeout(x.relay.ReadErr()) {
			rec.Outcome = metrics.OutcomeUpstreamTimeout
		} else {
			rec.Outcome = metrics.OutcomeUpstreamError
		}
		rec.Error = "upstream stream broken: " + describeStreamError(x.relay.ReadErr())
	case x.relay.Started() && !complete && writeErr == nil && x.relay.Fixed():
		rec.Outcome, rec.Error = metrics.OutcomeUpstreamError, "the upstream response ended before its Content-Length"
	case writeErr != nil || (x.relay.Started() && !complete):
		rec.Outcome = metrics.OutcomeClientCancel
		if writeErr != nil {
			rec.Error = "cannot write to client: " + describeStreamError(writeErr)
		}
	case rec.Status >= 500 || x.tap.StreamError():
		rec.Outcome = metrics.OutcomeUpstreamError
		if x.tap.StreamError() {
			rec.Error = "error reported inside the response"
		}
	}

	x.fillRecord(now)
	x.cs.Fill(&x.rec, x.tap.Arrival())
	x.tap.FillReading(&x.rec)
	for _, o := range x.snap.observers {
		o.observe(x, complete)
	}
	if !x.shadow {
		x.p.inflight.Add(-1)
	}
	releaseExchange(x)
}

// accountBody makes everything the body says known to the tap: what the
// side decoder has left of a compressed body (once it is done), and a
// complete body read whole (not streamed): its usage, its error. Then the
// admission ticket goes back with the tokens used: before the record,
// which may wait a round trip for the client's ACK, or a client that sends
// its next request as soon as a response ended would find its own slot
// still taken. Called once per exchange, before record.
func (x *exchange) accountBody(now time.Time, complete bool) {
	x.tap.Settle(now, complete)
	x.tap.CheckUsage(x.rec.BytesIn, x.in.encoded, x.relay.BytesOut(), now)
	if len(x.tap.Model()) > 0 && x.rt != nil {
		// Priced as the model that served it.
		x.charge = x.chargeFor(string(x.tap.Model()))
	}
	x.releaseTicket()
}

// fillRecord derives the record's timings from the tap.
func (x *exchange) fillRecord(now time.Time) {
	x.rec.BytesOut = x.relay.BytesOut()
	x.tap.Fill(&x.rec, now)
	if x.att.up != nil {
		x.rec.UpstreamAddr = x.att.up.Addr()
	}
	if x.rt != nil {
		in := x.tap.InputTokens(x.rec.BytesIn)
		x.rec.Class = x.snap.cfg.Classes.Of(in, x.rec.OutputTokens, x.rec.CachedTokens)
	}
	measure.PriceRecord(&x.rec, x.charge, &x.tap, len(x.snap.cfg.Prices) > 0)
}

// judge judges the finished record against its route's SLO, under the
// tenant's overrides.
func (x *exchange) judge() {
	if x.rt == nil {
		return
	}
	slo := x.slo()
	slo.Judge(&x.rec)
}

// wireOf returns the delivery counters of the client connection under c
// (plain or TLS), or nil for a connection tokentap did not accept.
func wireOf(c net.Conn) *measure.Wire {
	if cc := downstream.Of(c); cc != nil {
		return &cc.Wire
	}
	return nil
}

// startClientSide starts the measure of the response's delivery on the
// client's connection: the whole connection's, or one HTTP/2 stream's.
func (x *exchange) startClientSide() {
	if s, ok := x.client.(*downstream.Stream); ok {
		if cc := s.Conn(); cc != nil {
			x.cs.StartStream(&cc.Wire, s.Counts(), s.ConnSent())
		}
		return
	}
	x.cs.Start(wireOf(x.client))
}

// isPlain reports a plain client connection tokentap accepted (not one
// over TLS): one tokentap can write a response to itself.
func isPlain(c net.Conn) bool {
	_, ok := c.(*downstream.Conn)
	return ok
}

// Delivered stamps the delivery at t of the chunk last handed to the
// client (the body relay's sink): its tokens, the bytes the client side
// counts after it, and the marks that watch for its acknowledgement.
func (x *exchange) Delivered(t time.Time) {
	x.live()
	sent := x.cs.Sent()
	tok, ans := x.tap.Wrote(t, x.cs.Stalled(), sent)
	x.cs.LaterBytes(t, sent)
	x.MarkAcks(tok, ans, t, sent)
}

// ClientLeft cancels the exchange: its client left while a relay loop
// relayed its stream.
func (x *exchange) ClientLeft() {
	x.live()
	x.fire()
}

// Unwatch stops watching the client: a relay loop took the stream, and
// watches the client's close itself.
func (x *exchange) Unwatch() {
	x.live()
	x.watch.Stop()
}

// Rewatch watches the client again, once a stream a relay loop could not
// take (or let go of) stays on its goroutine.
func (x *exchange) Rewatch() {
	x.live()
	x.watch.Start(x.client, x.fire, &x.p.loops)
}

// MarkAcks is told that the delivery at t (the connection's count at
// sent) carried the stream's first token (tok) and first answer token
// (ans): the first token teaches the upstream's model; with the client
// side measured, the client's acknowledgement of their bytes is watched.
// Only streams are marked.
func (x *exchange) MarkAcks(tok, ans bool, t time.Time, sent int64) {
	x.live()
	if tok {
		x.learnFirst()
	}
	if x.tap.Streamed() && !x.p.opts.NoClientSide {
		x.cs.Mark(&x.p.clientAcks, tok, ans, t, sent, x.p.now)
	}
}

// awaitAck hands x to the proxy's watch of the records waiting for the
// client's acknowledgement of the response's end, once ClientSide.Ended
// said its record waits (x.fin holds what record needs): the watch looks
// at it (NextLook, LookNow) and records it when its wait is over.
func (x *exchange) awaitAck() {
	if x.cs.Schedule(x.p.now()) {
		x.recordEnd()
		return
	}
	x.p.waiting.Add(x, x.p.now)
}

// NextLook and LookNow make a waiting record a looker of ackWatch.
func (x *exchange) NextLook() time.Time {
	x.live()
	return x.cs.NextLook()
}

func (x *exchange) LookNow(now time.Time, ti *sock.TCPInfo) bool {
	x.live()
	if x.cs.Look(now, ti) || x.cs.Schedule(now) {
		x.recordEnd()
		return true
	}
	return false
}
