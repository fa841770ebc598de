package proxy

import (
	"net"
	"time"

	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
)

// The exchange's side of the delivery to the client (proxy/measure's
// ClientSide): each chunk's delivery stamped, the first tokens' bytes
// watched for the client's acknowledgement, and a record that waits for
// the acknowledgement of the response's end.

// wireOf returns the delivery counters of the client connection under c
// (plain or TLS), or nil for a connection tokentap did not accept.
func wireOf(c net.Conn) *measure.Wire {
	if cc := downstream.Of(c); cc != nil {
		return &cc.Wire
	}
	return nil
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
	sent := x.cs.Sent()
	tok, ans := x.tap.Wrote(t, x.cs.Stalled(), sent)
	x.cs.LaterBytes(t, sent)
	x.MarkAcks(tok, ans, t, sent)
}

// ClientLeft cancels the exchange: its client left while a relay loop
// relayed its stream.
func (x *exchange) ClientLeft() { x.fire() }

// Unwatch stops watching the client: a relay loop took the stream, and
// watches the client's close itself.
func (x *exchange) Unwatch() { x.watch.Stop() }

// Rewatch watches the client again, once a stream a relay loop could not
// take (or let go of) stays on its goroutine.
func (x *exchange) Rewatch() { x.watch.Start(x.client, x.fire, &x.p.loops) }

// MarkAcks is told that the delivery at t (the connection's count at
// sent) carried the stream's first token (tok) and first answer token
// (ans): the first token teaches the upstream's model; with the client
// side measured, the client's acknowledgement of their bytes is watched.
// Only streams are marked.
func (x *exchange) MarkAcks(tok, ans bool, t time.Time, sent int64) {
	if tok {
		x.learnFirst()
	}
	if x.tap.Streamed() && !x.p.opts.NoClientSide {
		x.cs.Mark(&x.p.clientAcks, tok, ans, t, sent, x.p.now)
	}
}

// ackWatch looks at the acknowledgements of every response whose record
// waits for one (measure.LookWatch), and records each when its wait is
// over.
type ackWatch struct{ measure.LookWatch }

// add hands x to the watch once ClientSide.Ended said its record waits
// (x.fin holds what record needs).
func (w *ackWatch) add(x *exchange) {
	if x.cs.Schedule(x.p.now()) {
		x.recordEnd()
		return
	}
	w.LookWatch.Add(x, x.p.now)
}

// NextLook and LookNow make a waiting record a looker of ackWatch.
func (x *exchange) NextLook() time.Time { return x.cs.NextLook() }

func (x *exchange) LookNow(now time.Time, ti *sock.TCPInfo) bool {
	if x.cs.Look(now, ti) || x.cs.Schedule(now) {
		x.recordEnd()
		return true
	}
	return false
}
