package proxy

import (
	"errors"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/valyala/fasthttp"
)

// refusal is a request tokentap answers itself, and what its record says:
// the status, the outcome, and the code and message of the JSON error body
// (tokentap's words only: never a header value, an upstream's bytes or an
// address). Every step of the request path returns one to refuse, the one
// place that answers and records it.
type refusal struct {
	status  int
	outcome metrics.Outcome
	code    string
	msg     string
	note    string // the record's error when it says more than msg

	close       bool          // close the connection: the request body was not read
	allow       string        // the Allow header of a 405
	rateLimited bool          // a 429: Retry-After and the x-ratelimit-* headers
	retryAfter  time.Duration // when a retry can succeed
	// errType is the error body's type ("": tokentap_error); anthropic
	// answers in Anthropic's shape ({"type":"error","error":{…}}).
	errType   string
	anthropic bool
}

func (r *refusal) Error() string { return r.msg }

// The refusals that carry nothing of their request, made once.
var (
	refuseMethod = &refusal{status: fasthttp.StatusMethodNotAllowed, outcome: metrics.OutcomeBadRequest, code: "method_not_allowed",
		msg: "this method is not relayed", close: true, allow: "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"}
	refuseHeaderName = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "invalid_header",
		msg: "a header name is not a valid token", close: true}
	refuseFraming = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "ambiguous_framing",
		msg: "the request has both Content-Length and Transfer-Encoding", close: true}
	refusePath = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "invalid_path",
		msg: "the request path cannot be normalised", close: true}
	refuseNoRoute = &refusal{status: fasthttp.StatusNotFound, outcome: metrics.OutcomeBadRequest, code: "no_route",
		msg: "no route matches this path", close: true}
	refuseKey = &refusal{status: fasthttp.StatusUnauthorized, outcome: metrics.OutcomeLimited, code: "invalid_api_key",
		msg: "unknown or missing API key", close: true}
	refuseVersion = &refusal{status: fasthttp.StatusHTTPVersionNotSupported, outcome: metrics.OutcomeBadRequest, code: "http_version_not_supported",
		msg: "only HTTP/1.1 and HTTP/1.0 are served", close: true}
	refuseMethodCase = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "invalid_method",
		msg: "the method must be upper case", close: true}
	refuseFold = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "folded_header",
		msg: "folded header lines are not accepted", close: true}
	refuseBodyTooLarge = &refusal{status: fasthttp.StatusRequestEntityTooLarge, outcome: metrics.OutcomeBadRequest, code: "body_too_large",
		msg: "the request body is too large", close: true}
	refuseBodiesBusy = &refusal{status: fasthttp.StatusServiceUnavailable, outcome: metrics.OutcomeRejected, code: "busy",
		msg: "too many request bodies are being received: try again", close: true, retryAfter: time.Second}
	refuseBodyTimeout = &refusal{status: fasthttp.StatusRequestTimeout, outcome: metrics.OutcomeBadRequest, code: "request_timeout",
		msg: "the request body was not received in time", close: true}
	refuseBodyUnreadable = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "bad_request",
		msg: "the request body cannot be read", close: true}
	refuseModel = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "model_not_allowed",
		msg: "this model is not served here"}
	refuseGone            = &refusal{status: 499, outcome: metrics.OutcomeClientCancel, msg: "client closed the connection"}
	refuseGoneWhileQueued = &refusal{status: 499, outcome: metrics.OutcomeClientCancel, msg: "client closed the connection while queued"}

	// What fasthttp could not parse (serveError).
	refuseUnparsable = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "bad_request",
		msg: "the request cannot be parsed", close: true}
	refuseHeadersTooLarge = &refusal{status: fasthttp.StatusRequestHeaderFieldsTooLarge, outcome: metrics.OutcomeBadRequest, code: "headers_too_large",
		msg: "the request headers are too large", close: true}
	refuseBareLF = &refusal{status: fasthttp.StatusBadRequest, outcome: metrics.OutcomeBadRequest, code: "bad_request",
		msg: "the request's header lines must end with CRLF", close: true}
	refuseRequestTimeout = &refusal{status: fasthttp.StatusRequestTimeout, outcome: metrics.OutcomeBadRequest, code: "request_timeout",
		msg: "the request was not received in time", close: true}
)

// parseRefusal says what a request fasthttp could not read gets.
// fasthttp's error text quotes the request, credentials included: only its
// kind is used.
func parseRefusal(err error) *refusal {
	var small *fasthttp.ErrSmallBuffer
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return refuseBodyTooLarge
	case errors.As(err, &small) || errors.Is(err, fasthttp.ErrSmallReadBuffer):
		return refuseHeadersTooLarge
	case errors.Is(err, downstream.ErrBareLF):
		return refuseBareLF
	case sock.IsTimeout(err):
		return refuseRequestTimeout
	}
	return refuseUnparsable
}

// describeUpstreamError says in tokentap's words what went wrong with the
// upstream: never its address, its bytes or a header. The errno, when
// there is one, says why.
func describeUpstreamError(err error) string {
	var why string
	var errno syscall.Errno
	if errors.As(err, &errno) {
		why = ": " + errno.Error()
	}
	var op *net.OpError
	switch {
	case errors.Is(err, upstream.ErrTooManyConns):
		return "upstream connection limit reached"
	case errors.As(err, &op) && op.Op == "dial":
		if sock.IsTimeout(err) {
			return "cannot connect to the upstream: timed out"
		}
		return "cannot connect to the upstream" + why
	case errors.Is(err, upstream.ErrWriteUpstream):
		if sock.IsTimeout(err) {
			return "cannot send the request upstream: timed out"
		}
		return "cannot send the request upstream" + why
	case errors.Is(err, upstream.ErrReadUpstream):
		switch {
		case sock.IsTimeout(err):
			return "the upstream did not answer in time"
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			return "the upstream closed the connection before answering"
		case why != "":
			return "the upstream connection failed" + why
		}
		return "the upstream sent an invalid response"
	case sock.IsTimeout(err): // os.ErrDeadlineExceeded included
		return "the upstream timed out"
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return "the upstream closed the connection"
	case why != "":
		return "upstream connection failed" + why
	}
	return "upstream failure"
}

// describeStreamError names what broke a relay already under way, without
// the addresses a net.OpError carries.
func describeStreamError(err error) string {
	var errno syscall.Errno
	switch {
	case sock.IsTimeout(err):
		return "timed out"
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return "connection closed"
	case errors.As(err, &errno):
		return errno.Error()
	case errors.Is(err, net.ErrClosed):
		return "connection closed"
	}
	return "connection failed"
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
