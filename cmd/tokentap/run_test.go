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
	"testing"
	"time"

	"github.com/tokentap/tokentap/examples/mockllm"
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
	for i := 0; i < 200; i++ {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%s not up", url)
}

// The whole program as a user runs it: flags, proxy, admin listener, access
// log file, and a clean stop.
func TestRunEndToEnd(t *testing.T) {
	backend := &http.Server{Handler: mockllm.New(mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond})}
	bln, _ := net.Listen("tcp", "127.0.0.1:0")
	go backend.Serve(bln)
	defer backend.Close()

	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	stop := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- run([]string{"-upstream", "http://" + bln.Addr().String(), "-listen", listen, "-admin", admin, "-access-log", logPath}, stop)
	}()
	waitUp(t, "http://"+admin+"/healthz")

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
	mresp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metricsText, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	for _, want := range []string{
		`tokentap_ttft_seconds_count{route="default",model="other"} 1`,
		`tokentap_requests_total{route="default",model="other",outcome="ok",status_class="2xx"} 1`,
		`tokentap_output_tokens_total{route="default",model="other"} 5`,
	} {
		if !strings.Contains(string(metricsText), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	close(stop)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("run did not stop")
	}
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
