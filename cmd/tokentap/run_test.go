package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func waitUp(t *testing.T, url string) {
	t.Helper()
	// Wait for the event: a busy machine can take seconds to start it.
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			return
		}
	}
	t.Fatalf("%s not up", url)
}

// The whole program as a user runs it: flags, proxy, admin listener, access
// log file, and a clean stop.
func TestRunEndToEnd(t *testing.T) {
	wait.Long(t, "the binary's run, a stream through it, its access log file")
	backend := &http.Server{Handler: mockllm.New(mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond})}
	bln, _ := net.Listen("tcp", "127.0.0.1:0")
	go backend.Serve(bln)
	defer backend.Close()

	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	prog := startRun(t, []string{"-upstream", "http://" + bln.Addr().String(), "-listen", listen, "-admin", admin, "-access-log", logPath})
	waitUp(t, "http://"+admin+"/healthz")
	// Series live for the process (they survive reloads): other tests in
	// it counted on the same ones.
	watched := []string{
		`tokentap_ttft_seconds_count{route="default",model="m"}`,
		`tokentap_requests_total{route="default",model="m",outcome="ok",status_class="2xx"}`,
		`tokentap_output_tokens_total{route="default",model="m"}`,
	}
	before := make([]int, len(watched))
	for i, series := range watched {
		before[i] = seriesValue(t, admin, series)
	}

	resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","stream":true,"max_tokens":5,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
		t.Fatalf("stream: %q", body)
	}
	// The record is made once the client's kernel acknowledged the end:
	// wait for it, then for nothing more.
	waitSeries(t, admin, watched[0], before[0]+1)
	for i, want := range []int{1, 1, 5} {
		if got := seriesValue(t, admin, watched[i]) - before[i]; got != want {
			t.Errorf("%s grew by %d, want %d", watched[i], got, want)
		}
	}

	prog.stop()
	f, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var lines []map[string]any
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("bad log line %q: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	if len(lines) != 1 || lines[0]["output_tokens"] != float64(5) || lines[0]["tokens_source"] != "usage" || lines[0]["ttft_ms"] == nil {
		t.Fatalf("access log: %v", lines)
	}
}

// Reload by POST /-/reload and by SIGHUP: a good file is swapped in, a bad
// one keeps the running config and says why, a stream in flight is not
// dropped, and a tenant at its limit stays there.
func TestReload(t *testing.T) {
	backend := &http.Server{Handler: mockllm.New(mockllm.Options{TokenGap: 20 * time.Millisecond, PrefillBase: time.Millisecond})}
	bln, _ := net.Listen("tcp", "127.0.0.1:0")
	go backend.Serve(bln)
	defer backend.Close()
	up := "http://" + bln.Addr().String()

	cfgPath := filepath.Join(t.TempDir(), "tokentap.yaml")
	write := func(s string) {
		if err := os.WriteFile(cfgPath, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	base := "routes:\n  - name: a\n    prefix: /v1/\n    upstream: " + up + "\n" +
		"tenants:\n  - name: t\n    keys: [k]\n    requests_per_second: 0.01\n    burst: 4\n"
	write(base)
	listen, admin := freeAddr(t), freeAddr(t)
	prog := startRun(t, []string{"-config", cfgPath, "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")

	post := func(path string) int {
		req, _ := http.NewRequest("POST", "http://"+listen+path, strings.NewReader(`{"stream":true,"max_tokens":3}`))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	reload := func() (int, string) {
		resp, err := http.Post("http://"+admin+"/-/reload", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b)
	}
	for i, want := range []int{200, 200} { // two of the tenant's burst of 4
		if got := post("/v1/chat/completions"); got != want {
			t.Fatalf("before reload, request %d: %d", i, got)
		}
	}
	if post("/other/v1/chat/completions") != 404 {
		t.Fatal("before reload: /other is served")
	}

	// A long stream in flight across the reload.
	streamDone := make(chan string, 1)
	admitted := make(chan struct{})
	go func() {
		req, _ := http.NewRequest("POST", "http://"+listen+"/v1/chat/completions", strings.NewReader(`{"stream":true,"max_tokens":20}`))
		req.Header.Set("Authorization", "Bearer k")
		resp, err := http.DefaultClient.Do(req)
		close(admitted) // its header came: it was admitted, it counts
		if err != nil {
			streamDone <- err.Error()
			return
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			streamDone <- err.Error()
			return
		}
		streamDone <- string(b)
	}()
	<-admitted

	write("routes:\n  - name: a\n    prefix: /v1/\n    upstream: " + up + "\n  - name: b\n    prefix: /other\n    strip_prefix: true\n    upstream: " + up + "\n" +
		"tenants:\n  - name: t\n    keys: [k]\n    requests_per_second: 0.01\n    burst: 4\n")
	if code, body := reload(); code != 200 {
		t.Fatalf("reload: %d %s", code, body)
	}
	if post("/other/v1/chat/completions") != 200 { // the new route works; tenant t had one of its 4 requests left
		t.Fatal("new route not served after reload")
	}
	if code := post("/v1/chat/completions"); code != 429 {
		t.Fatalf("tenant at its limit got %d after reload: its limiter state was reset", code)
	}
	if s := <-streamDone; !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("stream across the reload: %q", s)
	}

	write("routes:\n  - name: a\n    prefix: v1\n")
	code, body := reload()
	if code != 400 || !strings.Contains(body, "routes[0].prefix") {
		t.Fatalf("bad reload: %d %s", code, body)
	}
	if post("/other/v1/chat/completions") != 429 { // still the last good config (and t is limited)
		t.Fatal("bad file replaced the running config")
	}

	// SIGHUP takes the same path.
	write("routes:\n  - name: a\n    prefix: /v1/\n    upstream: " + up + "\n")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for post("/other/v1/chat/completions") != 404 { // no tenants any more, and no /other route
		if time.Now().After(deadline) {
			t.Fatal("SIGHUP did not reload")
		}
		time.Sleep(20 * time.Millisecond)
	}
}
