package upstream

import (
	"bufio"
	"strings"
	"testing"

	"github.com/valyala/fasthttp"
)

// Every hop-by-hop header goes, whatever its case and wherever it stands,
// and so do the headers a Connection header names; the others stay with
// their values, in both directions.
func TestDropHop(t *testing.T) {
	hop := "connection: X-Secret, keep-alive\r\nX-Secret: s\r\nPROXY-CONNECTION: keep-alive\r\nKeep-Alive: timeout=5\r\n" +
		"Proxy-Authenticate: Basic\r\nproxy-authorization: Basic eA==\r\nTE: trailers\r\nTrailer: X-T\r\nUpgrade: h2c\r\n"
	keep := map[string]string{"X-Kept": "1", "Authorization": "Bearer k", "Content-Type": "application/json"}
	var kept strings.Builder
	for k, v := range keep {
		kept.WriteString(k + ": " + v + "\r\n")
	}
	check := func(name string, h interface {
		Peek(string) []byte
		Len() int
	}, want int) {
		t.Helper()
		for _, n := range append(append([]string(nil), hopHeaders...), "X-Secret") {
			if v := h.Peek(n); len(v) > 0 {
				t.Errorf("%s: %s kept (%q)", name, n, v)
			}
		}
		for k, v := range keep {
			if got := string(h.Peek(k)); got != v {
				t.Errorf("%s: %s = %q, want %q", name, k, got, v)
			}
		}
		if h.Len() != want {
			t.Errorf("%s: %d headers left, want %d", name, h.Len(), want)
		}
	}

	var req fasthttp.Request
	raw := "POST /v1/x HTTP/1.1\r\nHost: h\r\n" + hop + kept.String() + "Expect: 100-continue\r\nContent-Length: 2\r\n\r\nhi"
	if err := req.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		t.Fatal(err)
	}
	hops, own, _ := scanRequest(&req.Header)
	if own || hops&connectionBit == 0 {
		t.Errorf("request: own %v, Connection's bit %v", own, hops&connectionBit != 0)
	}
	dropHop(&req.Header, hops, &req.Header)
	check("request", &req.Header, len(keep)+2) // with Host and Content-Length

	var resp fasthttp.Response
	resp.StreamBody = true
	raw = "HTTP/1.1 200 OK\r\n" + hop + kept.String() + "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
	if err := resp.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		t.Fatal(err)
	}
	hops, _ = scanResponse(&resp.Header)
	dropHop(&resp.Header, hops, &resp.Header)
	check("response", &resp.Header, len(keep))
	if resp.Header.ConnectionClose() {
		t.Error("response: Connection: close set")
	}
}

// hopBit finds exactly the hop-by-hop names, in any case, and nothing of
// their lengths that is not one; scanRequest finds the first
// X-Forwarded-For and tokentap's own headers in every spelling.
func TestHeaderScans(t *testing.T) {
	for i, name := range hopHeaders {
		for _, k := range []string{name, strings.ToLower(name), strings.ToUpper(name)} {
			if got := hopBit([]byte(k)); got != 1<<i {
				t.Errorf("hopBit(%q) = %b, want %b", k, got, 1<<i)
			}
		}
		near := []byte(name)
		near[len(near)-1] ^= 1
		if got := hopBit(near); got != 0 {
			t.Errorf("hopBit(%q) = %b, want 0", near, got)
		}
	}
	if hopBit([]byte("Connection")) != connectionBit {
		t.Error("connectionBit is not Connection's")
	}
	for _, k := range []string{"User-Agent", "Accept", "Host", "Content-Type", "Authorization", strings.Repeat("x", 40)} {
		if got := hopBit([]byte(k)); got != 0 {
			t.Errorf("hopBit(%q) = %b, want 0", k, got)
		}
	}

	var req fasthttp.Request
	raw := "POST /v1/x HTTP/1.1\r\nHost: h\r\nx-forwarded-for: 10.0.0.1\r\nX-Forwarded-For: 10.0.0.2\r\nContent-Length: 0\r\n\r\n"
	if err := req.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		t.Fatal(err)
	}
	hops, own, xff := scanRequest(&req.Header)
	if hops != 0 || own || string(xff) != "10.0.0.1" {
		t.Errorf("scanRequest: hops %b, own %v, X-Forwarded-For %q; want 0, false, the first", hops, own, xff)
	}
	for _, k := range []string{"X-Tokentap-Tenant", "x_tokentap_tenant", "X-TOKENTAP-Class", "x-Tokentap_a"} {
		if !isOwn([]byte(k)) {
			t.Errorf("isOwn(%q) = false", k)
		}
	}
	for _, k := range []string{"X-Tokentapx-a", "Y-Tokentap-a", "X-Tokentap", "X-Token-tap-a"} {
		if isOwn([]byte(k)) {
			t.Errorf("isOwn(%q) = true", k)
		}
	}
}

// The upstream request's and the client's response's hop-by-hop pass, on
// the headers a typical client and backend send (none of them hop-by-hop).
func BenchmarkDropHop(b *testing.B) {
	var req fasthttp.Request
	raw := "POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nUser-Agent: bench\r\nContent-Type: application/json\r\n" +
		"Authorization: Bearer k\r\nAccept: */*\r\nX-Request-Id: r-1\r\nContent-Length: 2\r\n\r\nhi"
	if err := req.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		hops, _, _ := scanRequest(&req.Header)
		dropHop(&req.Header, hops, &req.Header)
	}
}

// Both header passes of a request, on the headers a typical client and
// backend send: the upstream request built from the client's, and the
// client's response header from the upstream's.
func BenchmarkHeaderRewrite(b *testing.B) {
	var ctx fasthttp.RequestCtx
	raw := "POST /v1/chat/completions HTTP/1.1\r\nHost: gw.example\r\nUser-Agent: bench/1.0\r\nContent-Type: application/json\r\n" +
		"Authorization: Bearer k\r\nAccept: */*\r\nAccept-Encoding: gzip\r\nX-Tenant: t1\r\nContent-Length: 2\r\n\r\nhi"
	if err := ctx.Request.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		b.Fatal(err)
	}
	var resp fasthttp.Response
	resp.StreamBody = true
	rawResp := "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Sat, 05 Dec 2026 10:00:00 GMT\r\nServer: llama.cpp\r\n" +
		"Access-Control-Allow-Origin: *\r\nKeep-Alive: timeout=5\r\nContent-Length: 300\r\n\r\n"
	if err := resp.Header.Read(bufio.NewReader(strings.NewReader(rawResp))); err != nil {
		b.Fatal(err)
	}
	up := &Backend{host: "127.0.0.1:8000"}
	var req fasthttp.Request
	var out fasthttp.ResponseHeader
	var scratch []byte
	id, path, body := []byte("0123456789abcdef"), []byte("/v1/chat/completions"), []byte("hi")
	b.ReportAllocs()
	for b.Loop() {
		req.Reset()
		out.Reset()
		scratch = up.Prepare(&ctx, &req, "", false, path, nil, body, id, scratch)
		CopyResponseHeader(&resp, &out, id)
	}
}
