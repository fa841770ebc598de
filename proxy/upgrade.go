package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/valyala/fasthttp"
)

// isWebSocketUpgrade reports a request asking to switch to the WebSocket
// protocol (Connection: upgrade, Upgrade: websocket). Other upgrades (h2c)
// are not relayed and, as before, go upstream without their Upgrade.
func isWebSocketUpgrade(h *fasthttp.RequestHeader) bool {
	return h.ConnectionUpgrade() && hasToken(h.Peek("Upgrade"), "websocket")
}

// hasToken reports a comma-separated header value holding tok (any case).
func hasToken(v []byte, tok string) bool {
	for len(v) > 0 {
		var part []byte
		part, v, _ = bytes.Cut(v, []byte(","))
		if bytes.EqualFold(bytes.TrimSpace(part), []byte(tok)) {
			return true
		}
	}
	return false
}

// refuseUpgrade answers a WebSocket upgrade on a route that does not relay
// them.
var refuseUpgrade = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "websocket_not_enabled",
	msg: "this route does not relay WebSocket upgrades (websocket: true turns them on)"}

// maxUpgradeHeader bounds the upstream's answer to an upgrade request.
const maxUpgradeHeader = 64 << 10

// upgrade sends an upgrade request upstream on a connection of its own
// (never pooled: it becomes the tunnel) and answers the client: a 101
// turns the client's connection and that one into a tunnel (tunnel); any
// other answer is relayed as it came, read whole (bounded), and the
// exchange ends.
func (x *exchange) upgrade(ctx *fasthttp.RequestCtx) *refusal {
	a := &x.att
	x.rec.Attempts = 1
	c, err := a.up.Get(x.cancel.Context(), true) // a new connection, counted in max_conns
	if err != nil {
		a.connectFailed = true
		return x.forwardResult(err)
	}
	x.in.scratch = a.up.Prepare(ctx, a.req, x.rt.strip(), x.rt.stripKey, x.in.path, x.in.query, nil, x.id, x.in.scratch)
	a.req.Header.Set("Connection", "Upgrade")
	a.req.Header.SetBytesV("Upgrade", ctx.Request.Header.Peek("Upgrade"))
	if x.tenant != "" {
		a.req.Header.Set(admission.TenantHeader, x.tenant)
	}
	head, err := x.sendUpgrade(c)
	if err != nil {
		a.up.Discard(c)
		return x.forwardResult(err)
	}
	x.responded = true
	x.rec.Status = statusOf(head)
	x.rec.UpstreamTTFB = max(x.p.now().Sub(x.tap.Written()), 0)
	if x.rec.Status != fasthttp.StatusSwitchingProtocols {
		// Refused (401, 403, 426…): the answer goes to the client as the
		// server's response.
		err := ctx.Response.ReadLimitBody(bufio.NewReader(io.MultiReader(bytes.NewReader(head), c.Reader())), 1<<20)
		a.up.Discard(c)
		if err != nil {
			return &refusal{status: fasthttp.StatusBadGateway, outcome: metrics.OutcomeUpstreamError, code: "upstream_unavailable",
				msg: "the upstream's answer to the upgrade cannot be read"}
		}
		x.relay.NoBody(int64(len(ctx.Response.Body())))
		x.Finish(nil)
		return nil
	}
	x.watch.Stop() // the tunnel watches both sides itself
	ctx.HijackSetNoResponse(true)
	client := x.client
	ctx.Hijack(func(hj net.Conn) { x.tunnel(hj, client, c, head) })
	return nil
}

// sendUpgrade writes the upgrade request on c and reads the answer's
// header, as it came, up to its blank line.
func (x *exchange) sendUpgrade(c *upstream.Conn) ([]byte, error) {
	t := x.rt.Timeouts
	_ = c.SetWriteDeadline(x.p.now().Add(t.Write))
	x.tap.Sent(x.p.now())
	if err := c.WriteRequest(x.att.req.Header.Write); err != nil {
		return nil, err
	}
	_ = c.SetReadDeadline(x.p.now().Add(t.FirstByte))
	var head []byte
	for {
		line, err := c.Reader().ReadSlice('\n')
		head = append(head, line...)
		switch {
		case err != nil:
			return nil, err
		case len(head) > maxUpgradeHeader:
			return nil, errors.New("the upstream's answer to the upgrade is too large")
		case bytes.Equal(line, []byte("\r\n")) || bytes.Equal(line, []byte("\n")):
			_ = c.SetDeadline(time.Time{})
			return head, nil
		}
	}
}

// statusOf reads the status code of a response header ("HTTP/1.1 101 …"),
// 0 when there is none.
func statusOf(head []byte) int {
	_, rest, ok := bytes.Cut(head, []byte(" "))
	if !ok || len(rest) < 3 {
		return 0
	}
	n := 0
	for _, c := range rest[:3] {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}

// tunnel relays bytes both ways between the client (read through hj,
// the server's read buffer first; written on client) and the upstream (c,
// read through its buffer first) after the upstream's 101, which goes to
// the client as it came. One side's end closes both, and the tunnel ends
// when both ways ended; a session idle both ways for the route's idle
// timeout is closed. The record says the bytes each way
// (bytes_in: client to upstream; bytes_out: upstream to client, the 101
// left out) and the session's length.
func (x *exchange) tunnel(hj, client net.Conn, c *upstream.Conn, head []byte) {
	t := &tunnelState{idle: x.rt.Timeouts.Idle}
	t.last.Store(time.Now().UnixNano())
	var up, down tunnelWay
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		down.run(t, client, c.Reader(), c.Conn, head) // upstream → client, after its 101
	}()
	go func() {
		defer wg.Done()
		up.run(t, c.Conn, hj, hj, nil) // client → upstream
	}()
	wg.Wait()
	_ = hj.Close()
	x.att.up.Discard(c)
	rec := &x.rec
	rec.BytesIn = up.n
	x.relay.NoBody(down.n - int64(len(head)))
	switch {
	case x.p.cutting.Load():
		rec.Outcome, rec.Error = metrics.OutcomeShutdown, "cut at shutdown: the drain timeout ran out"
	case down.err != nil:
		rec.Outcome, rec.Error = metrics.OutcomeUpstreamError, "websocket tunnel: the upstream side failed: "+describeStreamError(down.err)
	case up.err != nil:
		rec.Outcome, rec.Error = metrics.OutcomeClientCancel, "websocket tunnel: the client side failed: "+describeStreamError(up.err)
	}
	x.tap.Ended(x.p.now())
	x.Finish(nil)
}

// tunnelState is what the two ways of a tunnel share.
type tunnelState struct {
	idle  time.Duration
	last  atomic.Int64 // unix nanoseconds of the last byte either way
	ended atomic.Bool  // a way ended: errors of the other after it are the close
}

// tunnelWay is one way of a tunnel: what it carried and its failure (nil:
// it ended with its side's EOF, or after the other way ended).
type tunnelWay struct {
	n   int64
	err error
}

// run copies from r (reading from) to dst, head first, until r ends; then
// it closes both sides, which ends the other way. A read that waited idle
// gives up only when the other way was idle as long.
func (w *tunnelWay) run(t *tunnelState, dst net.Conn, r io.Reader, from net.Conn, head []byte) {
	fail := func(err error) {
		if !t.ended.Swap(true) || err == nil {
			w.err = err
		}
		_ = dst.Close()
		_ = from.Close()
	}
	if len(head) > 0 {
		n, err := dst.Write(head)
		w.n += int64(n)
		if err != nil {
			fail(err)
			return
		}
	}
	buf := make([]byte, 32<<10)
	for {
		_ = from.SetReadDeadline(time.Now().Add(t.idle))
		n, err := r.Read(buf)
		if n > 0 {
			t.last.Store(time.Now().UnixNano())
			m, werr := dst.Write(buf[:n])
			w.n += int64(m)
			if werr != nil {
				fail(werr)
				return
			}
		}
		switch {
		case err == nil:
		case sock.IsTimeout(err) && time.Since(time.Unix(0, t.last.Load())) < t.idle && !t.ended.Load():
			// The other way is busy: the session is not idle.
		case errors.Is(err, io.EOF):
			// One side closed: the session is over (WebSocket ends with its
			// own close frames, which went through; a half-open tunnel to a
			// silent upstream would hold the tenant's slot and the
			// connection until the idle timeout). Both sides close, as
			// nginx does.
			t.ended.Store(true)
			fail(nil)
			return
		default:
			if t.ended.Load() {
				err = nil // the other way's end closed this one
			}
			fail(err)
			return
		}
	}
}
