package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/ratelimit"
)

// Paths are matched and forwarded in their normal form: no path reaches an
// upstream outside its route's base, prefixes match on segment boundaries,
// and spellings of one path land on one route.
func TestFaultPathEscapes(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxy(t, up.url+"/default", func(c *Config) {
		c.Routes = append(c.Routes,
			Route{Name: "public", Prefix: "/public/", Upstream: up.url + "/public-only/", StripPrefix: true, Timeouts: DefaultTimeouts},
			Route{Name: "ollama", Prefix: "/ollama", Upstream: up.url + "/ollama-base", StripPrefix: true, Timeouts: DefaultTimeouts},
			Route{Name: "chat", Prefix: "/v1/", Upstream: up.url, Timeouts: DefaultTimeouts},
		)
	})
	for _, tc := range []struct {
		path, route, upstreamPath string
		status                    int
	}{
		{"/public/a", "public", "/public-only/a", 200},
		{"/public/../private", "default", "/default/private", 200},
		{"/public/%2e%2e/private", "default", "/default/private", 200},
		{"/public/x/%2E%2E/y", "public", "/public-only/y", 200},
		{"/public/..%2fprivate", "unmatched", "", 400},
		{"/public/..%5Cprivate", "unmatched", "", 400},
		{"/public/../../etc/passwd", "unmatched", "", 400},
		{"/ollama/api/chat", "ollama", "/ollama-base/api/chat", 200},
		{"/ollama", "ollama", "/ollama-base/", 200},
		{"/ollamaEVIL/api", "default", "/default/ollamaEVIL/api", 200},
		{"/%76%31/chat/completions", "chat", "/v1/chat/completions", 200},
		{"//v1/chat/completions", "chat", "/v1/chat/completions", 200},
		{"/v1/./chat//completions", "chat", "/v1/chat/completions", 200},
	} {
		status, body := getBody(t, tp.url, "GET", tc.path)
		rec := tp.rec.next(t)
		if status != tc.status || rec.Route != tc.route {
			t.Errorf("%s: status %d route %q, want %d %q (body %q)", tc.path, status, rec.Route, tc.status, tc.route, body)
			continue
		}
		if tc.status == 200 && body != tc.upstreamPath {
			t.Errorf("%s: upstream saw %q, want %q", tc.path, body, tc.upstreamPath)
		}
	}
	if n := up.count("/private"); n != 0 {
		t.Errorf("the upstream's /private was reached %d times", n)
	}
}

// A per-route tenant limit cannot be bypassed by spelling the path of the
// limited route another way.
func TestFaultRouteLimitNotBypassedBySpelling(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxy(t, up.url, func(c *Config) {
		c.Routes = append(c.Routes, Route{Name: "chat", Prefix: "/v1/", Upstream: up.url, Timeouts: DefaultTimeouts})
		c.Admission = &ratelimit.Config{Mode: ratelimit.ModeReject,
			Tenants: []ratelimit.Tenant{{Name: "acme", Keys: []string{"sk-acme"},
				Routes: map[string]ratelimit.Limits{"chat": {RequestsPerSecond: 0.001, Burst: 1}}}},
		}
	})
	statuses := []int{}
	for _, path := range []string{"/v1/chat/completions", "/%76%31/chat/completions", "//v1/chat/completions", "/v1//chat/completions"} {
		req, _ := http.NewRequest("POST", tp.url+path, strings.NewReader(`{}`))
		req.Header.Set("Authorization", "Bearer sk-acme")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		statuses = append(statuses, resp.StatusCode)
		if rec := tp.rec.next(t); rec.Route != "chat" {
			t.Errorf("%s: route %q, want chat", path, rec.Route)
		}
	}
	if statuses[0] != 200 || statuses[1] != 429 || statuses[2] != 429 || statuses[3] != 429 {
		t.Fatalf("statuses %v, want 200 then 429s", statuses)
	}
}

// Header names that are not tokens are refused, inbound copies of
// tokentap's own headers are dropped in every spelling, a body without
// Content-Type gains none, TRACE is not relayed, and an unsafe
// X-Request-Id is replaced by one value used everywhere.
func TestFaultRequestHeaders(t *testing.T) {
	var seen http.Header
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
		seen = r.Header.Clone()
		echo(c, r)
		return true
	})
	tp := startProxy(t, up.url, nil)
	status := func(raw string) int {
		t.Helper()
		_, br := rawRequest(t, tp.addr, raw)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%q: %v", raw, err)
		}
		io.Copy(io.Discard, resp.Body)
		tp.rec.next(t)
		return resp.StatusCode
	}
	for _, bad := range []string{"X Foo: a", "Transfer-Encoding x: chunked", "X@Y: 1"} {
		if got := status("GET /a HTTP/1.1\r\nHost: h\r\n" + bad + "\r\n\r\n"); got != 400 {
			t.Errorf("header %q: status %d, want 400", bad, got)
		}
	}
	if up.count("/a") != 0 {
		t.Fatal("a request with an invalid header name reached the upstream")
	}
	if got := status("TRACE /t HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-canary\r\n\r\n"); got != 405 {
		t.Errorf("TRACE: status %d, want 405", got)
	}
	if got := status("POST /b HTTP/1.1\r\nHost: h\r\nX_Tokentap_Tenant: evil\r\nx-tokentap-tenant: evil\r\nX-TOKENTAP_Other: 1\r\nContent-Length: 3\r\n\r\nabc"); got != 200 {
		t.Fatalf("POST: status %d", got)
	}
	for k := range seen {
		if strings.Contains(strings.ToLower(strings.ReplaceAll(k, "_", "-")), "x-tokentap-") {
			t.Errorf("upstream received %s", k)
		}
	}
	if ct, ok := seen["Content-Type"]; ok {
		t.Errorf("upstream received Content-Type %q for a body sent without one", ct)
	}

	_, br := rawRequest(t, tp.addr, "GET /c HTTP/1.1\r\nHost: h\r\nX-Request-Id: <script>alert(1)</script>\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	rec := tp.rec.next(t)
	id := resp.Header.Get("X-Request-Id")
	if len(id) != 32 || id != rec.RequestID || id != seen.Get("X-Request-Id") {
		t.Fatalf("request id: echoed %q, logged %q, forwarded %q", id, rec.RequestID, seen.Get("X-Request-Id"))
	}
}

// Slow and oversized request headers get the statuses that say so.
func TestFaultRequestTimeoutAndHeaderSize(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxyOpts(t, up.url, nil, Options{RequestReadTimeout: 300 * time.Millisecond})

	_, br := rawRequest(t, tp.addr, "GET /a HTTP/1.1\r\nHost: h\r\nX-Half")
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 408 {
		t.Errorf("slow headers: status %d, want 408", resp.StatusCode)
	}
	tp.rec.next(t)

	_, br = rawRequest(t, tp.addr, "GET /a HTTP/1.1\r\nHost: h\r\nX-Big: "+strings.Repeat("a", 40<<10)+"\r\n\r\n")
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 431 {
		t.Errorf("oversized headers: status %d, want 431", resp.StatusCode)
	}
	tp.rec.next(t)
}

// A Content-Length announces, it reserves nothing: 40 connections that
// each announce 32 MiB and send one byte hold a small fraction of it, and
// a request without a valid key is refused before its body is read.
func TestFaultContentLengthReservesNothing(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxyOpts(t, up.url, func(c *Config) {
		c.Routes = append(c.Routes, Route{Name: "keyed", Prefix: "/keyed/", Upstream: up.url, Timeouts: DefaultTimeouts})
	}, Options{MaxRequestBodySize: 64 << 20})
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	const conns = 40
	for i := 0; i < conns; i++ {
		c, _ := rawRequest(t, tp.addr, "POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 33554432\r\n\r\n{")
		_ = c
	}
	// Let every connection reach the handler and block on its body.
	waitUntil(t, func() bool { return tp.p.ClientConns() >= conns })
	time.Sleep(200 * time.Millisecond)
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	if grown > 16<<20 {
		t.Fatalf("%d connections announcing 32 MiB each grew the heap by %d MiB", conns, grown>>20)
	}
	t.Logf("heap grew by %.1f MiB for %d connections announcing 32 MiB each", float64(grown)/(1<<20), conns)
}

// Without a valid key the answer comes before the body: a client that
// announced a 10 MB body gets its 401 after the first 8 KiB.
func TestFaultUnknownKeyRefusedBeforeBody(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxy(t, up.url, func(c *Config) {
		c.Admission = &ratelimit.Config{Mode: ratelimit.ModeReject,
			Tenants: []ratelimit.Tenant{{Name: "acme", Keys: []string{"sk-acme"}}},
		}
	})
	// fasthttp reads up to 8 KiB of a body before the handler runs.
	c, br := rawRequest(t, tp.addr, "POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer sk-wrong\r\nContent-Length: 10000000\r\n\r\n"+strings.Repeat("a", 8<<10))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 401 || resp.Close != true {
		t.Fatalf("status %d close %v, want 401 and a closed connection", resp.StatusCode, resp.Close)
	}
	if rec := tp.rec.next(t); rec.Tenant != "unknown" || rec.BytesIn != 0 {
		t.Fatalf("record: tenant %q bytes_in %d", rec.Tenant, rec.BytesIn)
	}
}

// An upstream that declares more body than it sends and closes: the client
// never sees a complete response (its connection breaks), and the record
// says the response was incomplete. A fixed-length body this short is still
// in the server's write buffer when the upstream fails, so the client gets
// no byte of it; streamed bodies go out chunk by chunk as they arrive.
func TestFaultShortUpstreamBody(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"+strings.Repeat("x", 50))
		return false
	})
	tp := startProxy(t, up.url, nil)
	_, br := rawRequest(t, tp.addr, "GET /short HTTP/1.1\r\nHost: h\r\n\r\n")
	if resp, err := http.ReadResponse(br, nil); err == nil {
		b, err := io.ReadAll(resp.Body)
		if err == nil {
			t.Errorf("the client read a clean end of a 100-byte body after %d bytes", len(b))
		}
	}
	rec := tp.rec.next(t)
	if rec.Outcome != "upstream_error" || rec.Status != 200 || rec.Error == "" {
		t.Fatalf("record: outcome %q status %d error %q", rec.Outcome, rec.Status, rec.Error)
	}
}

// Requests whose framing two parsers could read differently are refused
// and never reach the upstream.
func TestFaultSmuggling(t *testing.T) {
	up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool { echo(c, r); return true })
	tp := startProxy(t, up.url, nil)
	for name, raw := range map[string]string{
		"cl and te":          "POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"te and cl":          "POST /s HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n",
		"double cl":          "POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
		"te gzip":            "POST /s HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n",
		"te twice":           "POST /s HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"space before colon": "POST /s HTTP/1.1\r\nHost: h\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
		"bad chunk size":     "POST /s HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
		"negative length":    "POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n",
		"two hosts":          "GET /s HTTP/1.1\r\nHost: h\r\nHost: evil\r\n\r\n",
		"absolute uri":       "GET http://evil/s HTTP/1.1\r\nHost: h\r\n\r\n",
	} {
		c, br := rawRequest(t, tp.addr, raw)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		io.Copy(io.Discard, resp.Body)
		if resp.StatusCode < 400 || resp.StatusCode >= 500 {
			t.Errorf("%s: status %d, want 4xx", name, resp.StatusCode)
		}
		tp.rec.next(t)
	}
	if n := up.count("/s"); n != 0 {
		t.Fatalf("%d smuggling attempts reached the upstream", n)
	}
}

// TestFaultHalfCloseWritesNothing: a client that half-closes after its
// request is cancelled (499 in the record) and gets nothing on the wire,
// as nginx does; it used to get "HTTP/1.1 499 Unknown Status Code".
func TestFaultHalfCloseWritesNothing(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		<-r.Context().Done() // answers nothing until cancelled
	})
	tp := startProxy(t, up.URL, nil)
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`))
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(time.Minute))
	got, err := io.ReadAll(c)
	if len(got) != 0 || err != nil {
		t.Errorf("the client got %q (%v), want nothing and the close", got, err)
	}
	if rec := tp.rec.next(t); rec.Status != 499 || rec.Outcome != "client_cancel" {
		t.Errorf("record: status %d outcome %s", rec.Status, rec.Outcome)
	}
}

// TestFaultRequestsAnsweredAtOnce: requests that announce too much or
// speak badly get their answer at once, as from nginx, not the read
// timeout's 408 (a minute here: the test reads for 30 s): a Content-Length
// over max_request_body with none of the body sent (413), a header ended
// by bare LFs (400), a folded header line (400), a lower-case method
// (400), HTTP/2.0 and 3.0 on the request line (505).
func TestFaultRequestsAnsweredAtOnce(t *testing.T) {
	var served atomic.Int64
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	})
	tp := startProxyOpts(t, up.URL, nil, Options{MaxRequestBodySize: 1 << 20, RequestReadTimeout: time.Minute})
	for _, c := range []struct {
		name, req string
		status    int
	}{
		{"Content-Length over the limit, no body", "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n", 413},
		{"Content-Length over the limit, some body", "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\nabc", 413},
		{"bare LF", "GET /x HTTP/1.1\nHost: x\n\n", 400},
		{"CRLF lines, bare LF blank line", "GET /x HTTP/1.1\r\nHost: x\r\n\n", 400},
		{"obs-fold", "GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400},
		{"obs-fold with a tab", "GET /x HTTP/1.1\r\nHost: x\r\nX-A: a\r\n\tb\r\n\r\n", 400},
		{"lower-case method", "get /x HTTP/1.1\r\nHost: x\r\n\r\n", 400},
		{"HTTP/2.0", "GET /x HTTP/2.0\r\nHost: x\r\n\r\n", 505},
		{"HTTP/3.0", "GET /x HTTP/3.0\r\nHost: x\r\n\r\n", 505},
		{"a good one", "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\na\n\nb\n\n", 200},
	} {
		c2, br := rawRequest(t, tp.addr, c.req)
		c2.SetReadDeadline(time.Now().Add(30 * time.Second))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%s: %d, want %d", c.name, resp.StatusCode, c.status)
		}
		if rec := tp.rec.next(t); rec.Status != c.status {
			t.Errorf("%s: record status %d", c.name, rec.Status)
		}
	}
	if served.Load() != 1 {
		t.Errorf("the upstream served %d requests, want the good one", served.Load())
	}
}

// TestHeadScanNeverRefusesAGoodRequest: kept-alive requests whose bodies
// hold blank lines, sent one byte per write, then pipelined, are all
// served: the bare-LF check reads headers only.
func TestHeadScanNeverRefusesAGoodRequest(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
	})
	tp := startProxy(t, up.URL, nil)
	body := "x\n\ny\r\n\r\n\n\nz"
	one := "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: " + itoa(len(body)) + "\r\n\r\n" + body
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	read := func(i int) {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(got) != body {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, got)
		}
	}
	for i := range 3 {
		for j := range len(one) {
			if _, err := c.Write([]byte{one[j]}); err != nil {
				t.Fatal(err)
			}
		}
		read(i)
	}
	io.WriteString(c, one+one+one)
	for i := range 3 {
		read(3 + i)
	}
	for range 6 {
		tp.rec.next(t)
	}
}
