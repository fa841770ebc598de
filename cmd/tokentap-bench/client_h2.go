package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
)

// An h2c:// URL makes the client speak HTTP/2 with prior knowledge, on
// Go's HTTP/2 client (net/http): the requests in flight share one
// connection, as a gateway's HTTP/2 clients do, up to the streams the
// server allows (then another). Token events are stamped as the body's
// reads return them (no kernel stamps: TTFTKernel and E2EKernel are the
// reads'), so an HTTP/2 arm compares with HTTP/2 arms.

// h2cTransport is the client's HTTP/2 transport.
func h2cTransport() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{Protocols: &p, DisableCompression: true, MaxIdleConnsPerHost: 64,
		DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}
}

// doH2 is do for an h2c client.
func (cl *client) doH2(id string, body []byte, stamped bool) result {
	res := result{ID: id, TTFT: -1, TTFTKernel: -1}
	ctx := context.Background()
	if cl.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cl.timeout)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, "POST", "http://"+cl.addr+cl.path, bytes.NewReader(body))
	if err != nil {
		res.Err = err.Error()
		return res
	}
	req.Host = cl.host
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	for k, v := range cl.h2Headers {
		req.Header.Set(k, v)
	}
	res.Start = time.Now()
	resp, err := cl.h2.RoundTrip(req)
	if err != nil {
		res.Err, res.Timeout = err.Error(), errors.Is(err, context.DeadlineExceeded)
		return res
	}
	defer resp.Body.Close()
	res.TTFB, res.Status = time.Since(res.Start), resp.StatusCode
	// The HTTP/1.1 client's body reader stamps and counts the events; its
	// connection only gives the parser (no kernel stamps on this one).
	b := &bodyReader{c: &conn{p: sse.NewParser(1 << 20)}, res: &res, stamped: stamped, whole: resp.ContentLength >= 0}
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			b.feed(buf[:n])
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			res.Err, res.Timeout = err.Error(), errors.Is(err, context.DeadlineExceeded)
			return res
		}
	}
	res.E2E = time.Since(res.Start)
	res.E2EKernel = res.E2E
	if b.whole {
		o := dialect.OpenAI.Body(b.body)
		res.Output, res.Input = o.Out, o.In
	}
	if res.Output == 0 {
		res.Output = len(res.Tokens)
	}
	return res
}
