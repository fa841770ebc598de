package proxy

import (
	"io"
	"net"

	"github.com/valyala/fasthttp"
)

// serveHTTP10 relays a body of unknown length to an HTTP/1.0 client, which
// cannot read chunked encoding: the body goes out unframed on a hijacked
// connection, ended by closing it. fasthttp would send chunked encoding.
func (x *exchange) serveHTTP10(ctx *fasthttp.RequestCtx) {
	h := &ctx.Response.Header
	h.SetContentLength(-2) // identity: no Content-Length, no Transfer-Encoding
	h.SetConnectionClose()
	h.SetProtocol([]byte("HTTP/1.0"))
	x.head = append(x.head[:0], h.Header()...)
	ctx.HijackSetNoResponse(true)
	ctx.Hijack(x.relayRaw)
}

// relayRaw writes the prepared header and then every chunk straight to the
// client connection, each Write reaching the socket at once. On an upstream
// failure the connection is reset, not closed cleanly, so the client can
// tell a broken body from a complete one.
func (x *exchange) relayRaw(c net.Conn) {
	if _, err := c.Write(x.head); err != nil {
		x.finish(err)
		return
	}
	_, err := x.WriteTo(c)
	if err != nil && x.readErr != nil && x.readErr != io.EOF {
		// The upstream broke: reset rather than close cleanly.
		if tc, ok := x.client.(interface{ SetLinger(int) error }); ok {
			_ = tc.SetLinger(0)
		}
	}
	x.finish(err)
}
