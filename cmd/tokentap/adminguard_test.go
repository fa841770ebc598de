package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// rawStatus sends one request on a connection of its own and returns the
// status code (0: the connection closed without an answer).
func rawStatus(t *testing.T, addr, req string) int {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, req); err != nil {
		return 0
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestAdminProbesAnswerWhileCapped: an address that holds the admin
// listener's 16 connections with half-sent requests cannot make liveness,
// readiness or the scrape fail; the connections past the cap serve those
// only, one request each.
func TestAdminProbesAnswerWhileCapped(t *testing.T) {
	listen, admin := freeAddr(t), freeAddr(t)
	prog := startRun(t, []string{"-upstream", startBackend(t, 0), "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	for range adminConnsPerIP {
		c, err := net.Dial("tcp", admin)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, "GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\n") // never ends
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics", "/healthz"} {
		if code := rawStatus(t, admin, "GET "+path+" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); code != 200 {
			t.Errorf("GET %s with the cap held: %d", path, code)
		}
	}
	if code := rawStatus(t, admin, "GET /stats HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); code != 429 {
		t.Errorf("GET /stats past the cap: %d, want 429", code)
	}
}

// TestAdminRefusesCrossSiteCalls: without a token, the admin listener
// answers only Hosts that name it (an IP literal, localhost, admin.hosts),
// so a page that rebinds its name to 127.0.0.1 reads nothing, and refuses
// a state change from another site's page; curl keeps working. With a
// token, the token decides.
func TestAdminRefusesCrossSiteCalls(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "c.yaml")
	if err := os.WriteFile(cfg, []byte("upstream: "+startBackend(t, 0)+"\nadmin: {hosts: [tokentap.internal]}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	listen, admin := freeAddr(t), freeAddr(t)
	_, port, _ := net.SplitHostPort(admin)
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	req := func(method, path, host string, headers ...string) string {
		h := ""
		for _, x := range headers {
			h += x + "\r\n"
		}
		return fmt.Sprintf("%s %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: 0\r\n\r\n", method, path, host, h)
	}
	for _, c := range []struct {
		req  string
		want int
	}{
		{req("GET", "/stats", "evil.example:"+port), 403},
		{req("GET", "/debug/pprof/cmdline", "evil.example"), 403},
		{req("GET", "/metrics", "evil.example"), 403},
		{req("POST", "/-/reload", "evil.example:"+port), 403},
		{req("GET", "/stats", "127.0.0.1:"+port), 200},
		{req("GET", "/stats", "localhost:"+port), 200},
		{req("GET", "/stats", "[::1]:"+port), 200},
		{req("GET", "/stats", "tokentap.internal:"+port), 200},
		{req("GET", "/healthz", "evil.example"), 200},
		{req("GET", "/readyz", "evil.example"), 200},
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Origin: http://evil.example"), 403},
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Sec-Fetch-Site: cross-site"), 403},
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Content-Type: text/plain"), 403},
		{req("POST", "/-/reopen", "127.0.0.1:"+port, "Content-Type: application/x-www-form-urlencoded"), 403},
		{req("POST", "/-/guard/reset", "127.0.0.1:"+port, "Origin: null"), 403},
		{req("POST", "/-/reload", "127.0.0.1:"+port), 200},                                   // curl
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Origin: http://127.0.0.1:"+port), 200}, // the dashboard's own origin
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Content-Type: application/json"), 200}, // not a form
		{req("POST", "/-/reload", "127.0.0.1:"+port, "Sec-Fetch-Site: same-origin"), 200},    // the page itself
	} {
		if got := rawStatus(t, admin, c.req); got != c.want {
			t.Errorf("%q: %d, want %d", strings.SplitN(c.req, "\r\nContent-Length", 2)[0], got, c.want)
		}
	}

	// With a token, the token decides, whatever the Host.
	tok := filepath.Join(dir, "token")
	os.WriteFile(tok, []byte("0123456789abcdef0123\n"), 0o600)
	os.WriteFile(cfg, []byte("upstream: http://127.0.0.1:1\nadmin: {token_file: "+tok+"}\n"), 0o600)
	if code := rawStatus(t, admin, req("POST", "/-/reload", "127.0.0.1:"+port)); code != 200 {
		t.Fatalf("reload to a token: %d", code)
	}
	for _, c := range []struct {
		req  string
		want int
	}{
		{req("GET", "/stats", "evil.example", "Authorization: Bearer 0123456789abcdef0123"), 200},
		{req("GET", "/stats", "127.0.0.1:"+port), 401},
	} {
		if got := rawStatus(t, admin, c.req); got != c.want {
			t.Errorf("%q: %d, want %d", strings.SplitN(c.req, "\r\nContent-Length", 2)[0], got, c.want)
		}
	}
}
