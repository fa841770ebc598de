package proxy

import (
	"io"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/valyala/fasthttp"
)

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
