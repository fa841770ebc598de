package upstream

import (
	"context"
	"net"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/valyala/fasthttp"
)

// Canceller ties a request's upstream connection to its client: a
// context done when the client left (Context), told which connection to
// close then (downstream.Cancel).
type Canceller interface {
	Context() context.Context
	Attach(c net.Conn) bool
	Detach()
	IsGone() bool
}

// Trip is what a round trip did: the connection the response header came
// on, when the request was last written (zero: never), and whether the
// last try could not connect.
type Trip struct {
	Conn          *Conn // nil for an h2c backend: its connections are its transport's
	Written       time.Time
	FirstByte     time.Time // when the response's header came (an h2c backend's; else Conn's)
	ConnectFailed bool
}

// RoundTrip sends req on a pooled or new connection of up and reads the
// response's header into resp (its body left as resp's stream; head: a
// HEAD request, no body), the wait for the header bounded by headerLimit
// too (0: the first-byte timeout alone). A client that leaves (cancel)
// stops it at any point; the connection is attached to cancel while it
// serves. The request is sent once more, on a new connection, only by
// MayResend's rule.
func (up *Backend) RoundTrip(cancel Canceller, req *fasthttp.Request, resp *fasthttp.Response, head bool, headerLimit time.Duration) (Trip, error) {
	if up.h2c {
		return roundTripH2C(up, cancel, req, resp, head, headerLimit)
	}
	var t Trip
	for attempt := 0; ; attempt++ {
		c, err := up.Get(cancel.Context(), attempt > 0)
		if err != nil {
			t.ConnectFailed = true
			return t, err
		}
		if !cancel.Attach(c.Conn) {
			up.Discard(c)
			return t, ErrCancelled
		}
		acked := int64(-1)
		if c.WasReused() {
			acked = c.AckedBefore()
		}
		c.LimitHeaderWait(headerLimit)
		written, err := c.Send(req, resp, head)
		t.Written = written
		if err == nil {
			t.Conn, t.FirstByte = c, c.FirstByte()
			return t, nil
		}
		unread := MayResend(c, acked, err)
		up.Discard(c)
		cancel.Detach()
		if cancel.IsGone() {
			return t, ErrCancelled
		}
		if !unread || attempt > 0 {
			return t, err
		}
		metrics.UpstreamRetry()
	}
}

// MayResend is the rule for sending a request again, on a new connection,
// after its attempt on c failed with err: only when the backend provably
// never received it. The connection was reused, no response byte came,
// the failure is a close or reset (not a timeout), and the backend's
// kernel acknowledged none of the request's bytes (TCP_INFO
// tcpi_bytes_acked unchanged since before the write: AckedBefore, -1 when
// unknown). A socket the backend had already closed answers data with a
// reset and acknowledges nothing; one whose backend read the request has
// acknowledged it, and sending it again would run (and bill) the
// generation twice.
func MayResend(c *Conn, ackedBefore int64, err error) bool {
	return c.WasReused() && ackedBefore >= 0 && c.FirstByte().IsZero() && !sock.IsTimeout(err) && sock.IsConnReset(err) &&
		c.BytesAcked() == ackedBefore
}
