package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"

	"github.com/tokentap/tokentap/metrics"
	"github.com/valyala/fasthttp"
)

// failure is a request tokentap answers itself, with what the record says.
type failure struct {
	status  int
	outcome metrics.Outcome
	code    string
	msg     string
}

// readBody reads the request body into the exchange's own buffer, which
// grows only as bytes arrive: a Content-Length announces, it reserves
// nothing. The server streams request bodies (StreamRequestBody) and has
// read at most 8 KiB of one before the handler runs. A body declared or
// found larger than limit is refused with 413.
func (x *exchange) readBody(ctx *fasthttp.RequestCtx, limit int) ([]byte, *failure) {
	if !ctx.Request.IsBodyStream() {
		return ctx.Request.Body(), nil
	}
	tooLarge := &failure{fasthttp.StatusRequestEntityTooLarge, metrics.OutcomeBadRequest, "body_too_large", "the request body is too large"}
	cl := ctx.Request.Header.ContentLength()
	if cl > limit {
		return nil, tooLarge
	}
	r := ctx.RequestBodyStream()
	buf := x.reqBody[:0]
	for cl < 0 || len(buf) < cl {
		if len(buf) == cap(buf) {
			// Double as bytes arrive; never past what is declared.
			next := max(2*cap(buf), 16<<10)
			if cl >= 0 {
				next = min(next, cl)
			}
			grown := make([]byte, len(buf), next)
			copy(grown, buf)
			buf = grown
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if len(buf) > limit {
			x.reqBody = buf[:0]
			return nil, tooLarge
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			x.reqBody = buf[:0]
			if isTimeout(err) {
				return buf, &failure{fasthttp.StatusRequestTimeout, metrics.OutcomeBadRequest, "request_timeout", "the request body was not received in time"}
			}
			return buf, &failure{fasthttp.StatusBadRequest, metrics.OutcomeBadRequest, "bad_request", "the request body cannot be read"}
		}
	}
	x.reqBody = buf
	return buf, nil
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
	case errors.Is(err, errTooManyConns):
		return "upstream connection limit reached"
	case errors.As(err, &op) && op.Op == "dial":
		if isTimeout(err) {
			return "cannot connect to the upstream: timed out"
		}
		return "cannot connect to the upstream" + why
	case errors.Is(err, errWriteUpstream):
		if isTimeout(err) {
			return "cannot send the request upstream: timed out"
		}
		return "cannot send the request upstream" + why
	case errors.Is(err, errReadUpstream):
		switch {
		case isTimeout(err):
			return "the upstream did not answer in time"
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			return "the upstream closed the connection before answering"
		case why != "":
			return "the upstream connection failed" + why
		}
		return "the upstream sent an invalid response"
	case isTimeout(err):
		return "the upstream timed out"
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return "the upstream closed the connection"
	case errors.Is(err, os.ErrDeadlineExceeded):
		return "the upstream timed out"
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
	case isTimeout(err):
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
