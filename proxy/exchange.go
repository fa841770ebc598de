package proxy

import (
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/relay"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// exchange is one request in flight, the one hub of its life and the only
// type that knows every part: its steps are files (serve.go, steer.go,
// forward.go, upgrade.go, finish.go), its parts each a type with its reset
// (kept) and its owner, given what they need and holding no exchange:
//
//	in     inbound             the client's request (below)
//	att    upstreamAttempt     the upstream chosen, the connection and
//	                           request of the current attempt (below)
//	tap    measure.Tap         parsing and measuring, no I/O (proxy/measure)
//	relay  relay.Body          every path of the body to the client
//	                           (proxy/relay), which knows the exchange only
//	                           as its Sink
//	cs     measure.ClientSide  the delivery on the client connection, and
//	                           the wait for its acknowledgement
//
// Hand-overs: the connection's goroutine runs ServeHTTP and, through the
// relay, the body and Finish (fasthttp calls Read, WriteTo and
// CloseWithError on it); a relay loop holds the relay and the tap while
// the stream is in it; the peer watch touches only cancel; after Finish a
// record that waits for the client's acknowledgement belongs to the
// proxy's watch of them (waiting), a compressed body's to its own
// goroutine; a shadow copy is an exchange of its own on its own
// goroutine. Released (releaseExchange), it goes back to the proxy's pool.
type exchange struct {
	p    *Proxy
	snap *snapshot
	rec  metrics.Record
	id   []byte

	rt      *route
	dialect dialect.Dialect
	client  net.Conn
	watch   downstream.Watch
	cancel  downstream.Cancel
	fire    func() // cancel.fire, made once per pooled exchange

	in    inbound            // the client's request: its path, body, stream flag (request.go)
	att   upstreamAttempt    // the attempts against the route's upstreams (attempt.go)
	tap   measure.Tap        // what the body is, how it is parsed and measured (proxy/measure)
	relay relay.Body         // the body's way to the client (proxy/relay)
	cs    measure.ClientSide // the response's delivery to the client connection (proxy/measure)
	fin   finishing          // what finish knew, while the record waits (ackWatch)

	// Admission control.
	tenant    string
	ticket    *ratelimit.Ticket
	estIn     int64          // estimated input tokens
	charge    measure.Charge // how it is priced (proxy/measure): by the request's model, then the served one
	modelIdx  int            // the model's metric index
	responded bool           // the upstream answered with headers
	finished  bool
	released  bool // back in the pool: nothing may reach it (live)
	shadow    bool // a copy sent to the route's shadow upstream (shadow.go)
}

// --- The request path, step by step (ServeHTTP runs serve). ---

// --- Measuring the body on the way (the tap, proxy/measure). ---

// startParsing chooses how the body is measured from its Content-Type and
// Content-Encoding (Tap.Start).
func (x *exchange) startParsing(resp *fasthttp.Response) {
	x.tap.Start(resp.Header.ContentType(), resp.Header.ContentEncoding(), x.dialect, x.snap.cfg.MaxEventBytes, x.snap.cfg.MaxDecodedBytes,
		x, len(x.snap.cfg.Prices) > 0)
	x.rec.Stream = x.tap.Streamed()
	if cc := downstream.Of(x.client); cc != nil {
		cc.Streaming(x.rec.Stream)
	}
	if x.rt != nil {
		x.tap.Pace(x.pace())
	}
}

// Observe feeds one upstream read, read at t, to the tap.
func (x *exchange) Observe(b []byte, t time.Time) {
	x.live()
	x.tap.Read(b, t)
	if x.tap.FirstPending() && !x.p.opts.NoClientSide && x.cs.MaySplit() {
		ti := takeInfo(x.p)
		x.cs.SplitFirst(ti)
		x.p.infos.Put(ti)
	}
	if h := holdRead.Load(); h != nil {
		(*h)(b)
	}
}

// holdRead, set by tests only, runs after each upstream read was fed to
// the tap and before it is written to the client: a gateway that holds
// tokens, to be told apart from an upstream that sends them late.
var holdRead atomic.Pointer[func(b []byte)]

// checkLive has every way into an exchange from its parts (the relay's
// Sink, the tap's AckMarker, the watch of records waiting for the
// client's ACK) check that it was not released: a part that outlived its
// request would reach the next request's exchange. The tests turn it on;
// a use after release is then a panic that names it.
var checkLive bool

// live panics, with checkLive, when x was released (releaseExchange).
func (x *exchange) live() {
	if checkLive && x.released {
		panic("proxy: an exchange was used after its release")
	}
}

// --- The end. ---

// finishing is what finish knew, kept for a record made later (recordLater,
// ackWatch).
type finishing struct {
	now            time.Time
	writeErr       error
	gone, complete bool
}

// upstreamAttempt is the request's attempts against its route's
// upstreams: the one chosen now, the connection and the upstream request
// and response of the current attempt, and those tried before (failover).
// Owner: the serving goroutine (a shadow copy's: its own goroutine).
type upstreamAttempt struct {
	mem            *routing.Member   // the upstream chosen, once routed
	up             *upstream.Backend // mem.Up
	conn           *upstream.Conn
	req            *fasthttp.Request
	resp           *fasthttp.Response
	connectFailed  bool              // the last attempt could not connect
	tried          []*routing.Member // upstreams tried before the current one
	attemptAt      time.Time         // when the current attempt began
	firstByteLimit time.Duration     // bounds the wait for the response header (failover)
	startK         int               // tokentap's requests in flight at the upstream when this one was sent to it
	counted        bool              // counted in the upstream's requests in flight (count)
	learned, ended bool              // its model learned its first token, its end (learnFirst, learnEnd)
}

// count counts the request in its upstream's requests in flight, from
// when it is picked until it ends, but for its wait in its tenant's
// admission queue (exchange.admit): startK is the level it starts at,
// tokentap's own requests there. The model files what the request lives
// at that level: a scrape (held) moves where a prediction is read, never
// where a measurement is filed, so a scrape that claims what is not so
// corrupts nothing the model keeps.
func (a *upstreamAttempt) count(now time.Time) {
	if a.counted || a.mem == nil {
		return
	}
	a.counted = true
	a.startK = int(a.mem.Up.Inflight.Add(1) - 1)
}

// uncount takes the request out of its upstream's requests in flight.
func (a *upstreamAttempt) uncount() {
	if a.counted {
		a.counted = false
		a.mem.Up.Inflight.Add(-1)
	}
}

// kept is the part's next life in a pooled exchange: the request and
// response objects, reset (a request let go of is taken again), and the
// list's room.
func (a *upstreamAttempt) kept() upstreamAttempt {
	if a.req == nil {
		a.req = fasthttp.AcquireRequest()
	} else {
		a.req.Reset()
	}
	a.resp.Reset()
	return upstreamAttempt{req: a.req, resp: a.resp, tried: a.tried[:0]}
}

// letRequestGo gives the request sent upstream back to fasthttp's pool
// once no attempt can send it again (a stream under way): an open stream
// then holds neither it nor its header's buffers (some 1.6 KB, a third of
// an idle stream's exchange), which the streams still starting take.
func (a *upstreamAttempt) letRequestGo() {
	fasthttp.ReleaseRequest(a.req)
	a.req = nil
}

// inbound is the client's request as tokentap holds it: its normalised
// path and raw query, its body (read in pieces that grow only as bytes
// arrive, counted against the proxy's bound), what the body asks for, and
// the scratch space for header values. Owner: the serving goroutine; a
// shadow copy takes what it needs before its own goroutine starts.
type inbound struct {
	path        []byte // the normalised request path
	query       []byte // the raw query, with its "?", a view of the request
	reqBody     []byte // the buffer the request body is read into
	body0       []byte // the request body (reqBody, or fasthttp's own)
	bodyHeld    int64  // request body bytes counted in Proxy.bodies (inbound.holdBody)
	injected    []byte // the request body with include_usage injected
	stream      bool   // the request asks for a stream
	scratch     []byte // header values being built
	traceparent []byte // the traceparent sent upstream (Options.Tracer)
	stickyKey   uint64 // the hash of the sticky key that chose the upstream (stickyKeyed)
	stickyKeyed bool
	late        bool // the route or upstream waits for the body (route.late)
	encoded     bool // the body has a Content-Encoding: its bytes hold more text
}

// kept is the part's next life in a pooled exchange: its buffers (a large
// body's goes with its request).
func (in *inbound) kept() inbound {
	body := in.reqBody[:0]
	if cap(body) > maxPooledBody {
		body = nil
	}
	return inbound{path: in.path[:0], reqBody: body, injected: in.injected[:0], scratch: in.scratch[:0], traceparent: in.traceparent[:0]}
}

// maxPooledBody is the largest request body buffer kept for the next
// request.
const maxPooledBody = 256 << 10

// readBody reads the request body into the request's own buffer, which
// grows only as bytes arrive: a Content-Length announces, it reserves
// nothing. The server streams request bodies (StreamRequestBody) and has
// read at most 8 KiB of one before the handler runs. A body declared or
// found larger than limit is refused with 413.
func (in *inbound) readBody(ctx *fasthttp.RequestCtx, limit int, p *Proxy) ([]byte, *refusal) {
	if len(ctx.Request.Header.Peek(bodyTooLarge)) > 0 {
		// Its Content-Length was over the limit (tooLargeToRead).
		return nil, refuseBodyTooLarge
	}
	if !ctx.Request.IsBodyStream() {
		return ctx.Request.Body(), nil
	}
	cl := ctx.Request.Header.ContentLength()
	if cl > limit {
		return nil, refuseBodyTooLarge
	}
	r := ctx.RequestBodyStream()
	buf := in.reqBody[:0]
	if !in.holdBody(p, int64(cap(buf))) {
		return nil, refuseBodiesBusy
	}
	for cl < 0 || len(buf) < cl {
		if len(buf) == cap(buf) {
			// Double as bytes arrive; never past what is declared, nor
			// past the budget of all requests' bodies.
			next := max(2*cap(buf), keptBodyBuffer)
			if cl >= 0 {
				next = min(next, cl)
			}
			if !in.holdBody(p, int64(next)) {
				in.reqBody = buf[:0]
				return nil, refuseBodiesBusy
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
			buf = grown
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if len(buf) > limit {
			in.reqBody = buf[:0]
			return nil, refuseBodyTooLarge
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			in.reqBody = buf[:0]
			if sock.IsTimeout(err) {
				return buf, refuseBodyTimeout
			}
			return buf, refuseBodyUnreadable
		}
	}
	in.reqBody = buf
	return buf, nil
}

// letBodyGo drops the request body once no attempt can send it again: a
// stream's prompt is not held for the stream's life, and its bytes leave
// the budget of all requests' bodies (Options.MaxBufferedBodies), where
// they would refuse new requests while long streams run (the upstream
// request goes too: letRequestGo). A buffer no larger than
// keptBodyBuffer stays with the exchange for its next request, and in the
// budget.
func (in *inbound) letBodyGo(p *Proxy) {
	in.body0 = nil
	if cap(in.injected) > keptBodyBuffer {
		in.injected = nil
	}
	if cap(in.reqBody) > keptBodyBuffer {
		in.reqBody = nil
		in.holdBody(p, 0)
	}
}

// keptBodyBuffer is the largest request body buffer a stream keeps for
// its exchange's next request: the size readBody first grows one to.
const keptBodyBuffer = 16 << 10

// holdBody counts n bytes of body buffer as this request's in the budget
// of all requests' bodies (Options.MaxBufferedBodies), in place of what it
// held; false, holding nothing more, when that would pass the budget.
func (in *inbound) holdBody(p *Proxy, n int64) bool {
	if p.bodies.Add(n-in.bodyHeld) > p.opts.MaxBufferedBodies && n > in.bodyHeld {
		p.bodies.Add(in.bodyHeld - n)
		return false
	}
	in.bodyHeld = n
	return true
}

// Bounds on client-supplied strings in records and logs.
const (
	maxLoggedPath  = 512
	maxLoggedModel = 128
	maxRequestID   = 128
)

// boundedString copies at most n bytes of b, marking a cut with "…".
func boundedString(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "…"
}

// bodyTooLarge marks a request whose Content-Length was over the limit
// (tooLargeToRead). A client that sends it itself only gets its own 413;
// dropOwn keeps it from ever reaching an upstream.
const bodyTooLarge = "X-Tokentap-Body-Too-Large"

// tooLargeToRead is the server's HeaderReceived: a request that announces
// a body over max is answered 413 at once, before any of it is read
// (fasthttp would first wait for up to 8 KiB of it, which a client that
// announced 1 GB and sent nothing never sends): its body is taken as empty
// and the connection closes after the answer.
func tooLargeToRead(max int) func(*fasthttp.RequestHeader) fasthttp.RequestConfig {
	return func(h *fasthttp.RequestHeader) fasthttp.RequestConfig {
		if max > 0 && h.ContentLength() > max {
			h.SetContentLength(0)
			h.Set(bodyTooLarge, "1")
			h.SetConnectionClose()
		}
		return fasthttp.RequestConfig{}
	}
}

// acquireExchange takes a pooled exchange for a request of generation s
// that began to arrive at arrival; releaseExchange gives it back, keeping
// its parts' buffers.
func acquireExchange(p *Proxy, s *snapshot, arrival time.Time) *exchange {
	x, _ := p.pool.Get().(*exchange)
	if x == nil {
		x = &exchange{p: p, att: upstreamAttempt{req: new(fasthttp.Request), resp: new(fasthttp.Response)}}
		x.fire = x.cancel.Fire
		x.relay.Parts = relay.Parts{Sink: x, Meter: &x.tap, Cancel: &x.cancel, Server: &p.relays}
	}
	x.snap, x.released = s, false
	x.tap.Begin(arrival)
	x.rec.Reset()
	x.rec.Tenant = "default"
	x.rec.Outcome = metrics.OutcomeOK
	return x
}

// takeInfo takes a TCP_INFO buffer for one reading, given back to
// p.infos after it: a response's end reads one on its goroutine, and an
// exchange that waits (an open stream) holds none.
func takeInfo(p *Proxy) *sock.TCPInfo {
	if ti, _ := p.infos.Get().(*sock.TCPInfo); ti != nil {
		return ti
	}
	return new(sock.TCPInfo)
}

func releaseExchange(x *exchange) {
	p := x.p
	*x = exchange{
		p: p, id: x.id[:0], in: x.in.kept(), att: x.att.kept(), tap: x.tap.Kept(), relay: x.relay.Kept(),
		watch: x.watch.Kept(), fire: x.fire, released: true,
	}
	p.pool.Put(x)
}
