package upstream

import (
	"slices"
	"strings"

	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/valyala/fasthttp"
)

// Backend credentials. A gateway that knows its tenants by tokentap's own
// keys sends the backend the backend's key, not the tenant's: a route's
// Headers (for all its upstreams) and an upstream's own (over the
// route's, name by name) are set on every request sent there, and the
// client's key headers are dropped where tenants are identified by key
// (unless Route.ForwardClientKey). Values come from the configuration,
// which reads them from the environment or a file (cmd/tokentap:
// ${env:NAME}, ${file:PATH}); tokentap never logs them, shows them in
// /stats or puts them in an error.

// Header is a request header set on every request sent upstream.
type Header struct{ Name, Value string }

// clientKeyHeaders are the headers a client presents its key in (apiKey):
// not forwarded where the key named the client to tokentap.
var clientKeyHeaders = []string{"Authorization", "X-Api-Key", "Api-Key", "X-Goog-Api-Key"}

// reservedHeaders are set by tokentap or the framing, never by the
// configuration: a credential header is none of them.
var reservedHeaders = []string{"Host", "Content-Length", "Transfer-Encoding", "Connection", "Te", "Trailer", "Upgrade",
	"Keep-Alive", "Proxy-Connection", "X-Request-Id", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Traceparent"}

// ValidHeaders checks a list of headers of field (routes[0].headers): a
// name that is a header name and none tokentap sets itself, each once, a
// value without line breaks or NUL (a header split in two). Errors name
// the header, never its value.
func ValidHeaders(hs []Header, field string) error {
	seen := map[string]bool{}
	for _, h := range hs {
		f := field + "." + h.Name
		canon := strings.ToLower(h.Name)
		switch {
		case !conf.IsToken(h.Name):
			return conf.Errf(field, "%q is not a header name", h.Name)
		case seen[canon]:
			return conf.Errf(f, "is given twice")
		case slices.ContainsFunc(reservedHeaders, func(r string) bool { return strings.EqualFold(r, h.Name) }) || isOwn([]byte(h.Name)):
			return conf.Errf(f, "is set by tokentap itself")
		case h.Value == "":
			return conf.Errf(f, "is empty (an environment variable or file that gave nothing?)")
		case strings.ContainsAny(h.Value, "\r\n\x00"):
			return conf.Errf(f, "holds a line break or NUL")
		}
		seen[canon] = true
	}
	return nil
}

// MergeHeaders is the route's headers with the upstream's own over them,
// name by name.
func MergeHeaders(route, own []Header) []Header {
	out := slices.Clone(own)
	for _, h := range route {
		if !slices.ContainsFunc(own, func(o Header) bool { return strings.EqualFold(o.Name, h.Name) }) {
			out = append(out, h)
		}
	}
	return out
}

// setCredentials drops the client's key headers from req when strip, then
// sets up's headers.
func setCredentials(req *fasthttp.RequestHeader, up *Backend, strip bool) {
	if strip {
		for _, name := range clientKeyHeaders {
			if req.Peek(name) != nil {
				req.Del(name)
			}
		}
	}
	for _, h := range up.headers {
		req.Set(h.Name, h.Value)
	}
}
