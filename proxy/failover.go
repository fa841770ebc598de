package proxy

import (
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/valyala/fasthttp"
)

// Failover sends a request whose upstream failed before any response byte
// reached the client to the route's next upstream: at most once to each,
// never after a byte went to the client, never for a client that left.
type Failover struct {
	// On lists the failures that fail over: FailoverConnect (the upstream
	// could not be reached), FailoverStatus5xx (it answered 5xx),
	// FailoverFirstToken (no body byte within FirstTokenTimeout of the
	// request written).
	On []string
	// FirstTokenTimeout bounds the wait for the first byte of the body: a
	// backend queueing too long is cut (closing its connection cancels the
	// work) and the next one tried. The response headers are held back
	// until then, so a failover is never seen by the client.
	FirstTokenTimeout time.Duration
}

// The failures a route can fail over on.
const (
	FailoverConnect    = "connect"
	FailoverStatus5xx  = "status_5xx"
	FailoverFirstToken = "first_token_timeout"
)

func (f *Failover) on(reason string) bool { return f != nil && slices.Contains(f.On, reason) }

// failoverReason says why the attempt that ended with err should fail
// over, or "". On success it may wait for the first body byte
// (first_token_timeout).
func (a *upstreamAttempt) failoverReason(ctx *fasthttp.RequestCtx, err error) string {
	fo := a.x.rt.Failover
	if fo == nil || len(a.x.rt.set.Members()) < 2 {
		return ""
	}
	switch {
	case err != nil && a.connectFailed:
		if fo.on(FailoverConnect) {
			return FailoverConnect
		}
	case err != nil && sock.IsTimeout(err) && a.conn == nil && fo.on(FailoverFirstToken) && fo.FirstTokenTimeout > 0:
		return FailoverFirstToken // no response header within the timeout
	case err == nil && a.resp.StatusCode() >= 500:
		if fo.on(FailoverStatus5xx) {
			return FailoverStatus5xx
		}
	case err == nil && fo.on(FailoverFirstToken) && fo.FirstTokenTimeout > 0 && !a.firstByteWithin(ctx, fo.FirstTokenTimeout):
		return FailoverFirstToken
	}
	return ""
}

// firstByteWithin waits until the response body's first byte is in, at
// most until timeout after the request was written. A response without a
// body passes at once.
func (a *upstreamAttempt) firstByteWithin(ctx *fasthttp.RequestCtx, timeout time.Duration) bool {
	c, resp := a.conn, a.resp
	if ctx.IsHead() || resp.StatusCode() < 200 || resp.StatusCode() == 204 || resp.StatusCode() == 304 ||
		resp.Header.ContentLength() == 0 || c.Buffered() > 0 {
		return true
	}
	left := timeout - a.x.p.now().Sub(a.x.tap.Written())
	if left <= 0 {
		return false
	}
	return c.ByteWithin(left)
}

// failover moves the request to the route's next upstream not tried yet
// (in the route's order, among those taking requests). It reports false
// when there is none.
func (a *upstreamAttempt) failover(reason string) bool {
	next := a.nextMember()
	if next == nil {
		return false
	}
	now := a.x.p.now()
	metrics.FailedOver(a.x.rt.Name, a.mem.Name, reason)
	if a.conn != nil {
		a.up.Discard(a.conn) // closing it cancels the backend's work
		a.conn = nil
	}
	a.x.cancel.Detach()
	a.req.Reset()
	a.resp.Reset()
	a.x.tap.Lost(now.Sub(a.attemptAt))
	if a.x.rec.Trace.Sampled {
		a.x.rec.Tries = append(a.x.rec.Tries, metrics.Try{Upstream: a.mem.Name, Addr: a.up.Addr(), Start: a.attemptAt,
			Duration: now.Sub(a.attemptAt), Reason: reason})
	}
	a.attemptAt = now
	a.tried = append(a.tried, a.mem)
	a.uncount()
	a.learned, a.ended = false, false
	a.mem = next
	a.count(now)
	a.up = next.Up
	a.x.rec.Upstream = next.Name
	a.x.rec.Series = a.x.snap.metrics.Series(next.Row, a.x.modelIdx)
	a.x.rec.Attempts++
	a.connectFailed = false
	a.x.tap.Strip(false)
	return true
}

// nextMember returns the upstream after the current one in the route's
// order that was not tried and takes requests, or nil.
func (a *upstreamAttempt) nextMember() *routing.Member {
	ms := a.x.rt.set.Members()
	at := slices.Index(ms, a.mem)
	for i := 1; i < len(ms); i++ {
		m := ms[(at+i)%len(ms)]
		if a.x.rt.set.Weight(m) > 0 && !slices.Contains(a.tried, m) {
			return m
		}
	}
	return nil
}
