package main

import (
	"io"
	"time"

	"github.com/valyala/fasthttp"
)

// runFastRelay is the bench's floor for an HTTP-aware Go proxy on
// tokentap's own libraries: fasthttp's server and client, each request
// parsed, sent upstream on a pooled connection and its response streamed
// back (chunked bodies flushed per read, as tokentap does), with nothing
// measured, recorded or logged. What tokentap costs above it is its
// measurement and safety work; what it costs above the TCP relay
// (runRelay) is HTTP itself, on fasthttp.
func runFastRelay(args []string) error {
	listen, upstream, err := relayFlags("fasthttp-relay", "127.0.0.1:8092", args)
	if err != nil {
		return err
	}
	return fastRelay(upstream).ListenAndServe(listen)
}

// fastRelay is the relay's server, relaying to upstream (host:port).
func fastRelay(upstream string) *fasthttp.Server {
	hc := &fasthttp.HostClient{Addr: upstream, StreamResponseBody: true, MaxConns: 1 << 20,
		MaxIdleConnDuration: time.Minute, NoDefaultUserAgentHeader: true, DisableHeaderNamesNormalizing: true}
	return &fasthttp.Server{
		NoDefaultServerHeader: true, NoDefaultDate: true, NoDefaultContentType: true,
		DisableHeaderNamesNormalizing: true, ReadBufferSize: 16 << 10,
		Handler: func(ctx *fasthttp.RequestCtx) {
			ctx.Request.Header.Del("Connection")
			resp := fasthttp.AcquireResponse()
			if err := hc.Do(&ctx.Request, resp); err != nil {
				fasthttp.ReleaseResponse(resp)
				ctx.Error("upstream unavailable", fasthttp.StatusBadGateway)
				return
			}
			resp.Header.CopyTo(&ctx.Response.Header)
			ctx.Response.Header.Del("Connection")
			body := resp.BodyStream()
			if body == nil {
				ctx.Response.SetBodyRaw(append([]byte(nil), resp.Body()...))
				fasthttp.ReleaseResponse(resp)
				return
			}
			cl := resp.Header.ContentLength()
			if cl < 0 {
				cl = -1
				ctx.Response.ImmediateHeaderFlush = true // the header goes out before a long first token
			}
			ctx.Response.SetBodyStream(&upstreamBody{Reader: body, resp: resp}, cl)
		},
	}
}

// upstreamBody hands the upstream response back once the server wrote
// its body (or gave up).
type upstreamBody struct {
	io.Reader
	resp *fasthttp.Response
}

func (b *upstreamBody) Close() error {
	err := b.resp.CloseBodyStream()
	fasthttp.ReleaseResponse(b.resp)
	return err
}
