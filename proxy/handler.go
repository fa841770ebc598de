package proxy

import (
	"bytes"
	"errors"
	"net"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/relay"
	"github.com/valyala/fasthttp"
)

// ServeHTTP relays one request, step by step (exchange.go): route (the
// headers: method, framing, path, route, dialect, tenant), readRequest (the
// body and model), admit, forward (up to the response headers), relay (the
// body, which the server then reads through the exchange). The first step
// that refuses ends the request, and refuse answers and records it.
func (p *Proxy) ServeHTTP(ctx *fasthttp.RequestCtx) {
	x := p.begin(ctx, ctx.Request.Header.Peek("X-Request-Id"))
	if r := x.serve(ctx); r != nil {
		x.refuse(ctx, r)
	}
}

// serveError answers requests fasthttp could not parse (or whose body was
// too large) and records them like any other.
func (p *Proxy) serveError(ctx *fasthttp.RequestCtx, err error) {
	if downstream.IsHandshakeError(err) {
		// No request: counted, not recorded, and nothing can be answered
		// over TLS; a plain HTTP request on the TLS port is answered 400
		// in plain text, as nginx does.
		metrics.TLSHandshakeFailed()
		downstream.AnswerPlainHTTP(err)
		ctx.SetConnectionClose()
		return
	}
	if reason := nothingRead(err); reason != "" {
		// No byte of a request came (a fresh connection, or one given back
		// after a response tokentap wrote, which the server serves anew):
		// the client closed it, or it stayed idle past its time. There is
		// no request to record or answer: the connection closes, and the
		// server's write of the empty answer it makes now fails on it (a
		// client that sent its next request just then would read that
		// answer as its own).
		metrics.ClientConnClosedIdle(reason)
		_ = ctx.Conn().Close()
		return
	}
	x := p.begin(ctx, nil)
	x.refuse(ctx, parseRefusal(err))
}

// nothingRead says why the server stopped waiting for a request of which
// no byte came ("reset", "timeout", "error"), or "" when err is about a
// request that began to arrive. The server hands such an error on as the
// connection's read returned it (a *net.OpError); once part of a header
// came, it wraps the error in its own words, and parse errors are its own.
func nothingRead(err error) string {
	oe, ok := err.(*net.OpError)
	switch {
	case !ok:
		return ""
	case oe.Timeout():
		return "timeout"
	case errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed):
		return "reset"
	}
	return "error"
}

// begin starts the exchange of a request: its arrival, its id (the
// client's when it is safe), and a record that counts as unmatched until a
// route is found.
func (p *Proxy) begin(ctx *fasthttp.RequestCtx, clientID []byte) *exchange {
	snap := p.snap.Load()
	x := p.acquireExchange(snap, p.arrival(ctx))
	p.inflight.Add(1) // until recorded (shadow copies never count: they never hold up a drain)
	p.monitor.Arm()
	rec := &x.rec
	rec.Series, rec.Route = snap.metrics.Unmatched(), metrics.UnmatchedRoute
	x.id = p.requestID(x.id[:0], clientID)
	rec.RequestID = string(x.id)
	rec.Method = methodString(ctx.Method())
	if t := p.opts.Tracer; t != nil {
		rec.Trace = t.StartTrace(ctx.Request.Header.Peek("traceparent"), ctx.Request.Header.Peek("tracestate"))
		x.tap.Trace()
	}
	return x
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

// requestID returns the client's X-Request-Id when it is short and made of
// safe characters (letters, digits, "-", "_", ".", ":"), so that the value
// echoed, forwarded and logged is the same; otherwise a new id.
func (p *Proxy) requestID(dst, client []byte) []byte {
	if len(client) == 0 || len(client) > maxRequestID {
		return p.newRequestID(dst)
	}
	for _, c := range client {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.' || c == ':') {
			return p.newRequestID(dst)
		}
	}
	return append(dst, client...)
}

// checkRequest refuses what the request line and headers alone make
// unsafe to relay.
func checkRequest(ctx *fasthttp.RequestCtx) *refusal {
	h := &ctx.Request.Header
	switch {
	case !bytes.Equal(h.Protocol(), strHTTP11) && !bytes.Equal(h.Protocol(), strHTTP10):
		return refuseVersion
	case !upperToken(h.Method()):
		// Methods are case-sensitive (RFC 9110 §9.1): "get" is no GET, and
		// an upstream may read it as one. nginx answers 400.
		return refuseMethodCase
	case hasFold(h.RawHeaders()):
		// A folded header line (obs-fold, RFC 9112 §5.2): refused, as
		// nginx does; read differently by different servers.
		return refuseFold
	case ctx.IsConnect() || ctx.IsTrace():
		// TRACE would echo the request, credentials included; CONNECT
		// would open a tunnel. Neither is an inference call.
		return refuseMethod
	case !validHeaderNames(&ctx.Request.Header):
		return refuseHeaderName
	case ctx.Request.Header.ContentLength() == -1 && hasContentLength(ctx.Request.Header.RawHeaders()):
		// Both framings (RFC 9112 §6.3): what an upstream or a proxy
		// before tokentap made of the body is unknowable. A smuggling try.
		return refuseFraming
	}
	return nil
}

var (
	strHTTP11 = []byte("HTTP/1.1")
	strHTTP10 = []byte("HTTP/1.0")
)

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

// upperToken reports whether a method is upper-case letters (and - or _).
func upperToken(m []byte) bool {
	for _, c := range m {
		if (c < 'A' || c > 'Z') && c != '-' && c != '_' {
			return false
		}
	}
	return len(m) > 0
}

// hasFold reports a folded (continued) header line among raw headers.
func hasFold(raw []byte) bool {
	for {
		i := bytes.IndexByte(raw, '\n')
		if i < 0 || i+1 >= len(raw) {
			return false
		}
		if raw[i+1] == ' ' || raw[i+1] == '\t' {
			return true
		}
		raw = raw[i+1:]
	}
}

// validHeaderNames reports whether every header name is an RFC 9110 token:
// a name with a space or a colon in it could be read differently by the
// upstream ("Transfer-Encoding x: chunked").
func validHeaderNames(h *fasthttp.RequestHeader) bool {
	for k := range h.All() {
		if len(k) == 0 {
			return false
		}
		for _, c := range k {
			if !conf.TokenChar(c) {
				return false
			}
		}
	}
	return true
}

// hasContentLength reports a Content-Length field among raw request
// headers.
func hasContentLength(raw []byte) bool {
	const name = "content-length:"
	for len(raw) > 0 {
		line := raw
		if i := bytes.IndexByte(raw, '\n'); i >= 0 {
			line, raw = raw[:i], raw[i+1:]
		} else {
			raw = nil
		}
		if len(line) >= len(name) && bytes.EqualFold(line[:len(name)], []byte(name)) {
			return true
		}
	}
	return false
}

// methodString returns the method as a string, without allocating for the
// common ones.
func methodString(m []byte) string {
	for _, s := range [...]string{"POST", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"} {
		if string(m) == s {
			return s
		}
	}
	return string(m)
}

// arrival is when the request began to reach tokentap: the kernel's receive
// time of its first bytes, so that time spent in the socket before tokentap
// read it counts in every figure, as the client lived it.
func (p *Proxy) arrival(ctx *fasthttp.RequestCtx) time.Time {
	now := p.now()
	if c := downstream.Of(ctx.Conn()); c != nil {
		return c.Arrival(now, p.opts.RequestReadTimeout)
	}
	return now
}

func writeJSONError(ctx *fasthttp.RequestCtx, status int, code, msg string, id []byte) {
	writeErrorBody(ctx, status, "tokentap_error", code, msg, id, false)
}

// writeErrorBody answers status with an error of type errType: in the
// OpenAI-compatible shape tokentap's errors have ({"error":{"type",
// "code", "message"}}), or Anthropic's ({"type":"error","error":{"type",
// "message"}}).
func writeErrorBody(ctx *fasthttp.RequestCtx, status int, errType, code, msg string, id []byte, anthropic bool) {
	ctx.Response.Reset()
	ctx.SetStatusCode(status)
	ctx.SetContentType("application/json")
	ctx.Response.Header.SetBytesV("X-Request-Id", id)
	b := []byte(`{"error":{"type":`)
	if anthropic {
		b = []byte(`{"type":"error","error":{"type":`)
	}
	b = appendJSONString(b, errType)
	if !anthropic {
		b = append(b, `,"code":`...)
		b = appendJSONString(b, code)
	}
	b = append(b, `,"message":`...)
	b = appendJSONString(b, msg)
	b = append(b, "}}\n"...)
	ctx.SetBody(b)
}

func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < 0x20:
			b = append(b, `\u00`...)
			b = append(b, "0123456789abcdef"[c>>4], "0123456789abcdef"[c&15])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// acquireExchange takes a pooled exchange for a request of generation s
// that began to arrive at arrival; releaseExchange gives it back, keeping
// its parts' buffers.
func (p *Proxy) acquireExchange(s *snapshot, arrival time.Time) *exchange {
	x, _ := p.pool.Get().(*exchange)
	if x == nil {
		x = &exchange{p: p, att: upstreamAttempt{req: new(fasthttp.Request), resp: new(fasthttp.Response)}}
		x.fire = x.cancel.Fire
		x.att.x = x
		x.relay.Parts = relay.Parts{Sink: x, Meter: &x.tap, Cancel: &x.cancel, Server: &p.relays}
	}
	x.snap = s
	x.tap.Begin(arrival)
	x.rec.Reset()
	x.rec.Tenant = "default"
	x.rec.Outcome = metrics.OutcomeOK
	return x
}

// takeInfo takes a TCP_INFO buffer for one reading, given back to
// p.infos after it: a response's end reads one on its goroutine, and an
// exchange that waits (an open stream) holds none.
func (p *Proxy) takeInfo() *sock.TCPInfo {
	if ti, _ := p.infos.Get().(*sock.TCPInfo); ti != nil {
		return ti
	}
	return new(sock.TCPInfo)
}

func (p *Proxy) releaseExchange(x *exchange) {
	*x = exchange{
		p: p, id: x.id[:0], in: x.in.kept(), att: x.att.kept(), tap: x.tap.Kept(), relay: x.relay.Kept(),
		watch: x.watch.Kept(), fire: x.fire,
	}
	p.pool.Put(x)
}
