package upstream

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

// connectionNames is what dropHop reads the Connection header's values
// from: the message h was copied from.
type connectionNames interface {
	PeekAll(key string) [][]byte
}

// dropHop removes the hop-by-hop headers found in h (found: a bit per
// hopHeaders entry, see hopBit), and the headers its Connection header(s)
// name, read from the message h was copied from (src), which are
// hop-by-hop as well; only a message that has one is looked up.
//
// Only the names found are deleted: most messages carry none, and each Del
// scans every header (deleting the ten names unconditionally was 4.7% of
// tokentap's CPU on small requests).
func dropHop(h hopHeader, found uint16, src connectionNames) {
	var named [][]byte
	if found&connectionBit != 0 {
		named = src.PeekAll("Connection")
	}
	for i, name := range hopHeaders {
		if found&(1<<i) != 0 {
			h.Del(name)
		}
	}
	for _, v := range named {
		for _, tok := range bytes.Split(v, []byte{','}) {
			tok = bytes.TrimSpace(tok)
			if len(tok) > 0 && !bytes.EqualFold(tok, []byte("close")) && !bytes.EqualFold(tok, []byte("keep-alive")) {
				h.DelBytes(tok)
			}
		}
	}
	h.ResetConnectionClose()
}

// hopLens has bit n set when a hop-by-hop header's name is n bytes long:
// most headers' lengths have none, and hopBit looks no further.
var hopLens = func() (m uint32) {
	for _, name := range hopHeaders {
		m |= 1 << len(name)
	}
	return m
}()

// hopBit returns the bit of the hop-by-hop header named k, or 0.
func hopBit(k []byte) uint16 {
	if len(k) >= 32 || hopLens&(1<<len(k)) == 0 {
		return 0
	}
	for i, name := range hopHeaders {
		if len(k) == len(name) && strings.EqualFold(name, string(k)) {
			return 1 << i
		}
	}
	return 0
}

// scanRequest finds, in one pass over the client's request header, its
// hop-by-hop headers (a bit each, hopBit), whether it carries a header
// of tokentap's own (isOwn), and its first X-Forwarded-For (ranging over
// the concrete type's iterator allocates nothing).
func scanRequest(h *fasthttp.RequestHeader) (hops uint16, own bool, xff []byte) {
	for k, v := range h.All() {
		hops |= hopBit(k)
		own = own || isOwn(k)
		if xff == nil && len(k) == len(hdrForwardedFor) && bytes.EqualFold(k, hdrForwardedFor) {
			xff = v
		}
	}
	return hops, own, xff
}

// scanResponse finds, in one pass, the hop-by-hop headers of h and
// whether it carries a request id of its own.
func scanResponse(h *fasthttp.ResponseHeader) (hops uint16, id bool) {
	for k, v := range h.All() {
		hops |= hopBit(k)
		id = id || len(v) > 0 && len(k) == len(hdrRequestID) && bytes.EqualFold(k, hdrRequestID)
	}
	return hops, id
}

// connectionBit is Connection's bit (hopHeaders[0]): only a header that
// has one names more hop-by-hop headers in it.
const connectionBit = 1 << 0

// The headers tokentap sets, in the canonical form fasthttp stores: set
// with SetCanonical, they skip the copy and normalisation of the key.
var (
	hdrForwardedHost  = []byte("X-Forwarded-Host")
	hdrForwardedFor   = []byte("X-Forwarded-For")
	hdrForwardedProto = []byte("X-Forwarded-Proto")
	hdrRequestID      = []byte("X-Request-Id")
	protoHTTPS        = []byte("https")
	protoHTTP         = []byte("http")
)

// Prepare turns the client's request into the upstream request for up:
// the same method, headers and body, minus hop-by-hop headers and
// tokentap's own, with the normalised path (under up's base path; strip
// is the route's prefix to take off it, "" for none) and the client's raw
// query, Host set for the upstream, the backend's credentials (and the
// client's key headers dropped with stripKey), and X-Forwarded-* and
// X-Request-Id added.
//
// scratch is a buffer the caller lends for building header values; the
// grown buffer is returned.
func (up *Backend) Prepare(ctx *fasthttp.RequestCtx, req *fasthttp.Request, strip string, stripKey bool, path, query, body, requestID, scratch []byte) []byte {
	in := &ctx.Request
	hops, own, prior := scanRequest(&in.Header)
	in.Header.CopyTo(&req.Header)
	dropHop(&req.Header, hops, &in.Header)
	if own {
		dropOwn(&req.Header)
	}
	// A body without Content-Type goes without one: fasthttp would add
	// application/octet-stream.
	req.Header.SetNoDefaultContentType(true)
	// tokentap speaks HTTP/1.1 upstream whatever the client speaks, so the
	// upstream connection stays pooled and streams stay chunked.
	req.Header.SetProtocol("HTTP/1.1")

	// path is normalised: no dot segments, so nothing escapes the base.
	if strip != "" {
		// Keep the slash that ends the prefix: /ollama/api/chat → /api/chat.
		path = path[len(strings.TrimSuffix(strip, "/")):]
	}
	uri := append(scratch[:0], up.basePath...)
	if len(path) == 0 || path[0] != '/' {
		uri = append(uri, '/')
	}
	uri = append(append(uri, path...), query...)
	req.Header.SetRequestURIBytes(uri)
	req.Header.SetHost(up.host)
	setCredentials(&req.Header, up, stripKey)
	if up.auth != "" {
		// The upstream's own credentials, from its URL, replace the
		// client's (which named the client to tokentap).
		req.Header.Set("Authorization", up.auth)
	}
	if host := in.Header.Host(); len(host) > 0 {
		req.Header.SetCanonical(hdrForwardedHost, host)
	}

	xff := uri[:0]
	if len(prior) > 0 {
		xff = append(append(xff, prior...), ", "...)
	}
	xff = appendIP(xff, ctx.RemoteAddr())
	req.Header.SetCanonical(hdrForwardedFor, xff)
	if ctx.IsTLS() {
		req.Header.SetCanonical(hdrForwardedProto, protoHTTPS)
	} else {
		req.Header.SetCanonical(hdrForwardedProto, protoHTTP)
	}
	req.Header.SetCanonical(hdrRequestID, requestID)
	req.SetBodyRaw(body)
	return xff
}

// dropOwn removes inbound copies of the headers tokentap sets itself
// (X-Tokentap-*, isOwn).
func dropOwn(h *fasthttp.RequestHeader) {
	var names [][]byte
	for k := range h.All() {
		if isOwn(k) {
			names = append(names, append([]byte(nil), k...))
		}
	}
	for _, k := range names {
		h.DelBytes(k)
	}
}

// isOwn reports a header name tokentap sets itself (X-Tokentap-*), in
// every spelling an upstream could read as one: any case, and with
// underscores for dashes, which some servers (CGI, WSGI) fold together.
func isOwn(k []byte) bool {
	return len(k) >= len("x-tokentap-") && (k[1] == '-' || k[1] == '_') && k[0]|0x20 == 'x' &&
		bytes.EqualFold(k[2:10], []byte("tokentap")) && (k[10] == '-' || k[10] == '_')
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

// CopyResponseHeader copies the upstream response's status and headers to
// the client's response, minus hop-by-hop headers and the framing, which
// the server sets from the relayed body.
func CopyResponseHeader(from *fasthttp.Response, to *fasthttp.ResponseHeader, requestID []byte) {
	from.Header.CopyTo(to)
	// CopyTo takes the upstream header's default-Content-Type setting
	// too: a response without Content-Type must go without one.
	to.SetNoDefaultContentType(true)
	hops, id := scanResponse(to)
	dropHop(to, hops, &from.Header)
	to.SetProtocol([]byte("HTTP/1.1"))
	if !id {
		to.SetCanonical(hdrRequestID, requestID)
	}
}
