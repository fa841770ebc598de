package upstream

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/valyala/fasthttp"
)

// Backends over h2c (upstreams[].protocol: h2c): HTTP/2 with prior
// knowledge, on connections of net/http's transport (Go's HTTP/2 client:
// its pool, its streams multiplexed on a connection up to the backend's
// SETTINGS_MAX_CONCURRENT_STREAMS, its pings). The request tokentap
// prepared (Prepare) is sent as it is; the response comes back into the
// fasthttp.Response the exchange reads, its body a stream, so that the
// relay, the measure and the record are those of an HTTP/1.1 backend.
// What differs: no kernel receive stamps (reads are stamped when they
// return), no first-byte wait before the body is read (first_token
// failover waits for the header only), and a connection is the
// transport's to pool: a stream that ends early is reset (RST_STREAM),
// the connection kept.

// Protocols of a backend.
const (
	ProtocolHTTP1 = "http/1.1"
	ProtocolH2C   = "h2c"
)

// h2cTransport is the pool's transport for an h2c backend, made once
// and kept across reloads with the pool.
func (p *Pool) h2cTransport(dial func(ctx context.Context, network, addr string) (net.Conn, error), t Timeouts) *http.Transport {
	p.h2Once.Do(func() {
		var protos http.Protocols
		protos.SetUnencryptedHTTP2(true)
		p.h2 = &http.Transport{
			Protocols:          &protos,
			DialContext:        dial,
			DisableCompression: true, // the client's Accept-Encoding goes as it came
			IdleConnTimeout:    t.IdleConn,
			HTTP2: &http.HTTP2Config{
				// A connection that answers nothing for this long is
				// closed (a ping first, after SendPingTimeout of silence).
				SendPingTimeout: 15 * time.Second,
				PingTimeout:     5 * time.Second,
			},
		}
	})
	return p.h2
}

// roundTripH2C is RoundTrip for an h2c backend. The request's context is
// the client's cancel (a client that leaves resets the stream); the wait
// for the header is bounded by the first-byte timeout (and headerLimit),
// the gap between two reads of the body by the idle timeout.
func roundTripH2C(up *Backend, cancel Canceller, req *fasthttp.Request, resp *fasthttp.Response, head bool, headerLimit time.Duration) (Trip, error) {
	var t Trip
	ctx, stop := context.WithCancelCause(cancel.Context())
	hreq, err := h2cRequest(ctx, up, req)
	if err != nil {
		stop(nil)
		return t, err
	}
	wait := up.t.FirstByte
	if headerLimit > 0 && (wait <= 0 || headerLimit < wait) {
		wait = headerLimit
	}
	var timer *time.Timer
	if wait > 0 {
		timer = time.AfterFunc(wait, func() { stop(errHeaderTimeout) })
	}
	t.Written = up.now()
	hresp, err := up.h2cTransport(up.dialer.DialContext, up.t).RoundTrip(hreq)
	if timer != nil {
		timer.Stop()
	}
	if err != nil {
		stop(nil)
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Op == "dial" {
			t.ConnectFailed = true
		}
		if c := context.Cause(ctx); c == errHeaderTimeout {
			err = errHeaderTimeout
		}
		return t, err
	}
	t.FirstByte = up.now()
	resp.SetStatusCode(hresp.StatusCode)
	for k, vs := range hresp.Header {
		for _, v := range vs {
			resp.Header.Add(k, v)
		}
	}
	if head || hresp.Body == http.NoBody {
		_ = hresp.Body.Close()
		stop(nil)
		resp.Header.SetContentLength(max(int(hresp.ContentLength), 0))
		resp.SkipBody = head
		return t, nil
	}
	resp.SetBodyStream(newH2CBody(hresp.Body, stop, up.t.Idle), int(hresp.ContentLength))
	return t, nil
}

// h2cRequest is req as net/http's: the target, Host and header fields
// Prepare set, the body buffered.
func h2cRequest(ctx context.Context, up *Backend, req *fasthttp.Request) (*http.Request, error) {
	u := "http://" + up.addr + string(req.RequestURI())
	hreq, err := http.NewRequestWithContext(ctx, string(req.Header.Method()), u, bytes.NewReader(req.Body()))
	if err != nil {
		return nil, err
	}
	hreq.ContentLength = int64(len(req.Body()))
	hreq.Host = string(req.Header.Host())
	for k, v := range req.Header.All() {
		switch strings.ToLower(string(k)) {
		case "host", "content-length", "connection", "transfer-encoding", "keep-alive", "upgrade", "te":
			continue
		}
		hreq.Header.Add(string(k), string(v))
	}
	return hreq, nil
}

// errHeaderTimeout: no response header within the first-byte timeout.
var errHeaderTimeout = timeoutError("upstream: no response header in time")

// errIdleGap: no byte of the body within the idle timeout.
var errIdleGap = timeoutError("upstream: no byte of the body in time")

// timeoutError is a timeout as a connection's deadline reports it
// (sock.IsTimeout), so that the outcome is the same as over HTTP/1.1.
type timeoutError string

func (e timeoutError) Error() string { return string(e) }
func (e timeoutError) Timeout() bool { return true }

// h2cBody is an h2c response's body: each read within the idle timeout
// of the last (past it the stream is reset and the read fails with
// errIdleGap); closing it resets a stream not read to its end.
type h2cBody struct {
	body  io.ReadCloser
	stop  context.CancelCauseFunc
	idle  time.Duration
	timer *time.Timer
	mu    sync.Mutex
	timed bool
}

func newH2CBody(body io.ReadCloser, stop context.CancelCauseFunc, idle time.Duration) *h2cBody {
	b := &h2cBody{body: body, stop: stop, idle: idle}
	if idle > 0 {
		b.timer = time.AfterFunc(idle, b.expire)
	}
	return b
}

func (b *h2cBody) expire() {
	b.mu.Lock()
	b.timed = true
	b.mu.Unlock()
	b.stop(errIdleGap)
}

func (b *h2cBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if b.timer != nil && err == nil {
		b.timer.Reset(b.idle)
	}
	if err != nil && err != io.EOF {
		b.mu.Lock()
		if b.timed {
			err = errIdleGap
		}
		b.mu.Unlock()
	}
	return n, err
}

func (b *h2cBody) Close() error {
	if b.timer != nil {
		b.timer.Stop()
	}
	err := b.body.Close()
	b.stop(nil)
	return err
}
