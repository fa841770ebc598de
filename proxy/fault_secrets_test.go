package proxy

import (
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// A canary key sent through every error path never comes back in an error
// body, the access log or tokentap's own log, and neither does an
// upstream's address or an upstream's bytes.
func TestFaultSecretsNeverInBodiesOrLogs(t *testing.T) {
	const canary = "sk-canary-7f3a9c1e5b"
	// An upstream that answers garbage quoting the request, and one that
	// resets mid-stream.
	garbage := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
		io.WriteString(c, "HTTP/1.1 ZZZ "+r.Header.Get("Authorization")+"\r\n\r\n")
		return false
	})
	reset := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		io.WriteString(c, "20\r\ndata: {\"choices\":[]}\n\n"+(r.Header.Get("Authorization") + "     ")[:5])
		c.(*net.TCPConn).SetLinger(0)
		return false
	})
	slow := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
		time.Sleep(300 * time.Millisecond)
		return false
	})
	deadAddr := deadAddr(t)

	var logBuf, alogBuf syncBuffer
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.AddSync(&logBuf), zapcore.DebugLevel))
	alog := metrics.NewAccessLog(zapcore.AddSync(&alogBuf), 0)
	short := DefaultTimeouts
	short.FirstByte = 100 * time.Millisecond
	tp := startProxyOpts(t, garbage.url, func(c *Config) {
		// The client's key goes upstream on these routes (forward_client_key):
		// the upstreams quote it back, and it must go no further.
		c.Routes[0].ForwardClientKey = true
		c.Routes = append(c.Routes,
			Route{Name: "reset", Prefix: "/reset/", Upstream: reset.url, Timeouts: DefaultTimeouts, ForwardClientKey: true},
			Route{Name: "slow", Prefix: "/slow/", Upstream: slow.url, Timeouts: short},
			Route{Name: "dead", Prefix: "/dead/", Upstream: "http://" + deadAddr, Timeouts: DefaultTimeouts},
			Route{Name: "keyed", Prefix: "/keyed/", Upstream: garbage.url, Timeouts: DefaultTimeouts, ForwardClientKey: true},
		)
		c.Admission = &ratelimit.Config{Mode: ratelimit.ModeReject, UnknownKey: "guests",
			Tenants: []ratelimit.Tenant{{Name: "acme", Keys: []string{"sk-acme-not-the-canary"}}, {Name: "guests"}}}
	}, Options{Logger: logger, Sinks: []metrics.Sink{alog}, MaxRequestBodySize: 1024, RequestReadTimeout: 300 * time.Millisecond})

	auth := "Authorization: Bearer " + canary + "\r\n"
	for name, raw := range map[string]string{
		"bad content-length": "POST /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "Content-Length: 1x\r\n\r\n",
		"cl and te":          "POST /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"double cl":          "POST /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
		"bad header name":    "GET /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "X Bad: 1\r\n\r\n",
		"bad request line":   "GET /v1/x HTTP/1.1 extra\r\nHost: h\r\n" + auth + "\r\n",
		"trace":              "TRACE /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "\r\n",
		"bad path":           "GET /v1/..%2f..%2fx HTTP/1.1\r\nHost: h\r\n" + auth + "\r\n",
		"body too large":     "POST /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "Content-Length: 5000\r\n\r\n" + strings.Repeat("a", 5000),
		"headers too large":  "GET /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "X-Big: " + canary + strings.Repeat("b", 40<<10) + "\r\n\r\n",
		"slow headers":       "GET /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "X-Half: " + canary,
		"garbage upstream":   "GET /v1/x HTTP/1.1\r\nHost: h\r\n" + auth + "\r\n",
		"reset mid-stream":   "POST /reset/x HTTP/1.1\r\nHost: h\r\n" + auth + "Content-Length: 2\r\n\r\n{}",
		"upstream timeout":   "GET /slow/x HTTP/1.1\r\nHost: h\r\n" + auth + "\r\n",
		"upstream refused":   "GET /dead/x HTTP/1.1\r\nHost: h\r\n" + auth + "\r\n",
		"x-api-key":          "POST /keyed/x HTTP/1.1\r\nHost: h\r\nX-Api-Key: " + canary + "\r\nContent-Length: 2\r\n\r\n{}",
	} {
		if name != "slow headers" && name != "headers too large" {
			// Close after the answer, so reading it to the end is quick.
			raw = strings.Replace(raw, "Host: h\r\n", "Host: h\r\nConnection: close\r\n", 1)
		}
		c, br := rawRequest(t, tp.addr, raw)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		got, _ := io.ReadAll(br)
		body := string(got)
		if !strings.HasPrefix(body, "HTTP/1.1 ") {
			t.Errorf("%s: no response: %q", name, body)
		}
		for _, secret := range []string{canary, deadAddr, garbage.ln.Addr().String(), reset.ln.Addr().String(), "ZZZ"} {
			if strings.Contains(body, secret) {
				t.Errorf("%s: the response holds %q:\n%s", name, secret, body)
			}
		}
		select {
		case <-tp.rec.ch:
		case <-time.After(time.Minute): // an event, not a time: a minute is a hang
			t.Fatalf("%s: answered %.40q, and no record within a minute", name, body)
		}
	}
	alog.Flush()
	for what, text := range map[string]string{"access log": alogBuf.String(), "tokentap's log": logBuf.String()} {
		for _, secret := range []string{canary, deadAddr, garbage.ln.Addr().String(), reset.ln.Addr().String(), "ZZZ"} {
			if strings.Contains(text, secret) {
				t.Errorf("the %s holds %q:\n%s", what, secret, text)
			}
		}
	}
	if n := strings.Count(alogBuf.String(), "\n"); n != 15 {
		t.Errorf("%d access-log lines for 15 requests", n)
	}
}

// A client-supplied string reaches the log bounded: a 1 MB model name
// makes a short field.
func TestFaultLoggedStringsBounded(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxyOpts(t, up.url, nil, Options{MaxRequestBodySize: 4 << 20})
	model := strings.Repeat("m", 1<<20)
	path := "/v1/" + strings.Repeat("p", 8000)
	resp, err := http.Post(tp.url+path, "application/json", strings.NewReader(`{"model":"`+model+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	rec := tp.rec.next(t)
	if len(rec.Model) > 200 || len(rec.Path) > 600 || !strings.HasPrefix(rec.Model, "mmm") {
		t.Fatalf("logged model %d bytes, path %d bytes", len(rec.Model), len(rec.Path))
	}
}

// TestFaultUpstreamCredentials: user:password@ in an upstream URL is sent
// as that upstream's Basic authorization in place of the client's, and
// appears in no response, record or log line, also when the upstream
// cannot be reached.
func TestFaultUpstreamCredentials(t *testing.T) {
	const password = "pw-canary-51d0e"
	var got []string
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		got = append(got, r.Header.Get("Authorization"))
		io.WriteString(w, `{"choices":[]}`)
	})
	withCreds := strings.Replace(up.URL, "http://", "http://ops:"+password+"@", 1)
	dead := "http://ops:" + password + "@127.0.0.1:1"
	var logBuf, alogBuf syncBuffer
	logger := zap.New(zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewDevelopmentEncoderConfig()), zapcore.AddSync(&logBuf), zapcore.DebugLevel))
	alog := metrics.NewAccessLog(zapcore.AddSync(&alogBuf), 0)
	tp := startProxyOpts(t, "", func(c *Config) {
		c.Routes = []Route{
			{Name: "ok", Prefix: "/", Upstream: withCreds, Timeouts: DefaultTimeouts},
			{Name: "dead", Prefix: "/dead", Upstream: dead, Timeouts: DefaultTimeouts},
		}
	}, Options{Logger: logger, Sinks: []metrics.Sink{alog}})
	for _, path := range []string{"/v1/chat/completions", "/dead/v1/chat/completions"} {
		req := mustReq(t, "POST", tp.url+path, `{"model":"m"}`)
		req.Header.Set("Authorization", "Bearer client-key")
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		rec := tp.rec.next(t)
		if strings.Contains(string(body), password) || strings.Contains(rec.Error, password) || strings.Contains(rec.Path, password) {
			t.Errorf("%s: the password came back: %q / %+v", path, body, rec)
		}
	}
	if len(got) != 1 || got[0] != "Basic b3BzOnB3LWNhbmFyeS01MWQwZQ==" { // ops:pw-canary-51d0e
		t.Errorf("the upstream got Authorization %q, want its own Basic credentials", got)
	}
	alog.Close()
	for what, text := range map[string]string{"access log": alogBuf.String(), "tokentap's log": logBuf.String()} {
		if strings.Contains(text, password) || strings.Contains(text, "b3BzOnB3") {
			t.Errorf("the password is in the %s:\n%s", what, text)
		}
	}
}
