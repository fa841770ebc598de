package proxy

import (
	"errors"
	"net"
	"runtime"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/valyala/fasthttp"
	"go.uber.org/zap"
)

// ServeHTTP relays one request, step by step (exchange.go): route (the
// headers: method, framing, path, route, dialect, tenant), readRequest (the
// body and model), admit, forward (up to the response headers), relay (the
// body, which the server then reads through the exchange). The first step
// that refuses ends the request, and refuse answers and records it.
func (p *Proxy) ServeHTTP(ctx *fasthttp.RequestCtx) {
	if cc := downstream.Of(ctx.Conn()); cc != nil && cc.H2() {
		// An HTTP/2 connection (its preface, or ALPN): the HTTP/2 server
		// takes it, and hands each of its streams back here.
		metrics.H2Conn()
		ctx.HijackSetNoResponse(true)
		ctx.Hijack(p.h2.Load().ServeConn)
		return
	}
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
	x := acquireExchange(p, snap, p.arrival(ctx))
	p.inflight.Add(1) // until recorded (shadow copies never count: they never hold up a drain)
	p.monitor.Arm()
	rec := &x.rec
	rec.Series, rec.Route = snap.metrics.Unmatched(), metrics.UnmatchedRoute
	x.id = p.requestID(x.id[:0], clientID)
	rec.RequestID = string(x.id)
	rec.Method = methodString(ctx.Method())
	rec.ClientProtocol = downstream.Protocol(ctx.Conn())
	metrics.ClientRequest(rec.ClientProtocol)
	if t := p.opts.Tracer; t != nil {
		rec.Trace = t.StartTrace(ctx.Request.Header.Peek("traceparent"), ctx.Request.Header.Peek("tracestate"))
		x.tap.Trace()
	}
	return x
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
	if s, ok := ctx.Conn().(*downstream.Stream); ok {
		return s.Arrival(now, p.opts.RequestReadTimeout)
	}
	if c := downstream.Of(ctx.Conn()); c != nil {
		return c.Arrival(now, p.opts.RequestReadTimeout)
	}
	return now
}

// Serve serves the proxy on ln until Shutdown: the one way to run it, so
// that every connection gets the client write timeout, the kernel's
// receive stamps and the connection caps. ln is best opened with Listen; a
// plain TCP listener is wrapped here.
func (p *Proxy) Serve(ln net.Listener) error {
	if _, ok := ln.(*downstream.Listener); !ok {
		ln = p.wrap(ln)
	}
	p.srvMu.Lock()
	if p.srv == nil {
		p.srv = p.server()
	}
	if h := p.h2.Load(); h == nil || h.Closed() {
		p.h2.Store(p.h2Server())
	}
	srv := p.srv
	p.stopping.Store(false)
	p.srvMu.Unlock()
	if !p.opts.GoroutineRelay {
		p.loops.Start(runtime.GOMAXPROCS(0), p.now)
	}
	return srv.Serve(ln)
}

// connState follows the server's connections: one it let go of for a
// response tokentap wrote (StateHijacked) can be given back (resume).
func (p *Proxy) connState(c net.Conn, s fasthttp.ConnState) {
	if s == fasthttp.StateHijacked {
		if cc, ok := c.(*downstream.Conn); ok {
			cc.HandedOver()
		}
	}
}

// server is the fasthttp.Server that relays through p: streamed bodies
// flushed per chunk, header names and dates passed through untouched, and
// parse errors answered (and recorded) by p.
func (p *Proxy) server() *fasthttp.Server {
	return &fasthttp.Server{
		Handler:                       p.ServeHTTP,
		ErrorHandler:                  p.serveError,
		NoDefaultServerHeader:         true,
		NoDefaultDate:                 true,
		NoDefaultContentType:          true,
		DisablePreParseMultipartForm:  true,
		DisableHeaderNamesNormalizing: false,
		ReadBufferSize:                16 << 10, // also the max request header size
		WriteBufferSize:               4 << 10,  // larger writes (stream chunks) bypass it
		MaxRequestBodySize:            p.opts.MaxRequestBodySize,
		HeaderReceived:                tooLargeToRead(p.opts.MaxRequestBodySize),
		// The handler reads the body itself, in pieces that grow only as
		// bytes arrive (exchange.readBody), after the headers identified
		// the tenant: a Content-Length alone reserves nothing.
		StreamRequestBody: true,
		ReadTimeout:       p.opts.RequestReadTimeout,
		// Responses advertise Keep-Alive: timeout=idle_timeout; the server
		// waits keepAliveGrace longer, so that a client that reuses the
		// connection within what it was told never races its close.
		IdleTimeout: p.idleWait(),
		// No WriteTimeout: it is one deadline for the whole response and
		// would cut long streams. clientConn has a sliding per-write
		// deadline instead.
		CloseOnShutdown: true,
		// Responses tokentap writes itself take the connection over and
		// give it back for the next request (relay.Body.ServePass); the
		// other hijacks close it themselves.
		KeepHijackedConns: true,
		ConnState:         p.connState,
		// fasthttp's error texts quote the request, credentials included.
		SecureErrorLogMessage: true,
		Logger:                zapPrintf{p.log},
	}
}

// h2Server is the HTTP/2 server of the connections that speak it: each
// stream served by ServeHTTP as a request of its own, with the limits of
// the HTTP/1.1 server where they have a counterpart.
func (p *Proxy) h2Server() *downstream.H2 {
	return downstream.NewH2(p.ServeHTTP, downstream.H2Options{
		MaxStreams:     h2MaxStreams,
		MaxHeaderBytes: 16 << 10, // the HTTP/1.1 server's read buffer
		IdleTimeout:    p.idleWait(),
		WriteTimeout:   p.opts.ClientWriteTimeout,
		ErrorLog:       zap.NewStdLog(p.log.Named("http2")),
		CountError:     metrics.H2Error,
	})
}

// h2MaxStreams is the streams an HTTP/2 client may have open at once on
// one connection (nginx's default).
const h2MaxStreams = 128
