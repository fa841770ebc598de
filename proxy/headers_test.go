package proxy

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
	dropHop(&req.Header, requestHops(&req.Header), req.Header.PeekAll("Connection"))
	check("request", &req.Header, len(keep)+2) // with Host and Content-Length

	var resp fasthttp.Response
	resp.StreamBody = true
	raw = "HTTP/1.1 200 OK\r\n" + hop + kept.String() + "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
	if err := resp.Header.Read(bufio.NewReader(strings.NewReader(raw))); err != nil {
		t.Fatal(err)
	}
	dropHop(&resp.Header, responseHops(&resp.Header), resp.Header.PeekAll("Connection"))
	check("response", &resp.Header, len(keep))
	if resp.Header.ConnectionClose() {
		t.Error("response: Connection: close set")
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
		dropHop(&req.Header, requestHops(&req.Header), nil)
	}
}
