package proxy

import (
	"bytes"
	"net"
	"strings"

	"github.com/valyala/fasthttp"
)

// hopHeaders are hop-by-hop (RFC 9110 §7.6.1): they describe one connection,
// never the message, so a proxy drops them in both directions. Expect is
// dropped too: the request body has already been read when it is forwarded.
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Expect",
}

// hopHeader is what dropHop needs of a fasthttp request or response header.
type hopHeader interface {
	Del(key string)
	DelBytes(key []byte)
	ResetConnectionClose()
}

// dropHop removes the hop-by-hop headers from h, and the headers named in
// connection, the values of the message's Connection header(s), which are
// hop-by-hop as well.
func dropHop(h hopHeader, connection [][]byte) {
	for _, name := range hopHeaders {
		h.Del(name)
	}
	for _, v := range connection {
		for _, tok := range bytes.Split(v, []byte{','}) {
			tok = bytes.TrimSpace(tok)
			if len(tok) > 0 && !bytes.EqualFold(tok, []byte("close")) && !bytes.EqualFold(tok, []byte("keep-alive")) {
				h.DelBytes(tok)
			}
		}
	}
	h.ResetConnectionClose()
}

// prepareRequest turns the client's request into the upstream request:
// the same method, URI, headers and body, minus hop-by-hop headers, with
// Host set for the upstream and X-Forwarded-* and X-Request-Id added.
//
// scratch is a buffer the caller lends for building header values; the
// grown buffer is returned.
func prepareRequest(ctx *fasthttp.RequestCtx, req *fasthttp.Request, r *route, requestID, scratch []byte) []byte {
	in := &ctx.Request
	in.Header.CopyTo(&req.Header)
	dropHop(&req.Header, in.Header.PeekAll("Connection"))
	// tokentap speaks HTTP/1.1 upstream whatever the client speaks, so the
	// upstream connection stays pooled and streams stay chunked.
	req.Header.SetProtocol("HTTP/1.1")

	// The URI as the client sent it (not normalized), under the route.
	uri := in.Header.RequestURI()
	if r.StripPrefix {
		// Keep the slash that ends the prefix: /ollama/api/chat → /api/chat.
		uri = uri[len(strings.TrimSuffix(r.Prefix, "/")):]
		if len(uri) == 0 || uri[0] != '/' {
			uri = append([]byte{'/'}, uri...)
		}
	}
	if r.up.basePath != "" {
		uri = append([]byte(r.up.basePath), uri...)
	}
	req.Header.SetRequestURIBytes(uri)
	req.Header.SetHost(r.up.host)
	if host := in.Header.Host(); len(host) > 0 {
		req.Header.SetBytesV("X-Forwarded-Host", host)
	}

	xff := scratch[:0]
	if prior := in.Header.Peek("X-Forwarded-For"); len(prior) > 0 {
		xff = append(append(xff, prior...), ", "...)
	}
	xff = appendIP(xff, ctx.RemoteAddr())
	req.Header.SetBytesV("X-Forwarded-For", xff)
	if ctx.IsTLS() {
		req.Header.Set("X-Forwarded-Proto", "https")
	} else {
		req.Header.Set("X-Forwarded-Proto", "http")
	}
	req.Header.SetBytesV("X-Request-Id", requestID)
	req.SetBodyRaw(in.Body())
	return xff
}

// appendIP appends the IP address of addr (a TCP address, IPv4-mapped
// addresses unmapped) without allocating.
func appendIP(b []byte, addr net.Addr) []byte {
	if ta, ok := addr.(*net.TCPAddr); ok {
		return ta.AddrPort().Addr().Unmap().AppendTo(b)
	}
	host, _, err := net.SplitHostPort(addr.String())
	if err != nil {
		return append(b, addr.String()...)
	}
	return append(b, host...)
}

// copyResponseHeader copies the upstream response's status and headers to
// the client's response, minus hop-by-hop headers and the framing, which
// the server sets from the relayed body.
func copyResponseHeader(from *fasthttp.Response, to *fasthttp.ResponseHeader, requestID []byte) {
	from.Header.CopyTo(to)
	dropHop(to, from.Header.PeekAll("Connection"))
	to.SetProtocol([]byte("HTTP/1.1"))
	if len(to.Peek("X-Request-Id")) == 0 {
		to.SetBytesV("X-Request-Id", requestID)
	}
}
