package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

func startBackend(t *testing.T, gap time.Duration) string {
	t.Helper()
	return startMockllm(t, mockllm.Options{TokenGap: gap, PrefillBase: time.Millisecond})
}

// startMockllm serves the simulated backend with o on 127.0.0.1 for the
// test and returns its base URL.
func startMockllm(t *testing.T, o mockllm.Options) string {
	t.Helper()
	backend := &http.Server{Handler: mockllm.New(o)}
	bln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go backend.Serve(bln)
	t.Cleanup(func() { backend.Close() })
	return "http://" + bln.Addr().String()
}

// runner is the program run as main runs it, in a goroutine.
type runner struct {
	t      *testing.T
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

// startRun runs the program with args until stop (or cancel, then wait).
func startRun(t *testing.T, args []string) *runner {
	ctx, cancel := context.WithCancel(context.Background())
	r := &runner{t: t, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- run(ctx, args) }()
	return r
}

// stop ends the run (as SIGTERM does) and waits for it.
func (r *runner) stop() {
	r.cancel()
	r.wait()
}

// wait waits for run to return and fails the test on its error.
func (r *runner) wait() {
	r.t.Helper()
	r.once.Do(func() {
		select {
		case err := <-r.done:
			if err != nil {
				r.t.Fatal(err)
			}
		case <-time.After(time.Minute):
			r.t.Fatal("run did not stop")
		}
	})
}

func logLines(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []map[string]any
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("bad log line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

func status(t *testing.T, method, url, token string) int {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// Shutdown with streams longer than the drain: /readyz turns 503 while
// /healthz stays 200, the listener closes after drain_delay, and every
// stream gets its record (outcome shutdown) before the process ends.
func TestDrainCutsLongStreamsAndRecordsThem(t *testing.T) {
	up := startBackend(t, 50*time.Millisecond)
	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	cfg := writeFile(t, "upstream: "+up+"\ndrain_timeout: 600ms\ndrain_delay: 300ms\n")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", logPath})
	waitUp(t, "http://"+admin+"/healthz")
	if got := status(t, "GET", "http://"+admin+"/readyz", ""); got != 200 {
		t.Fatalf("/readyz before the drain: %d", got)
	}

	const streams = 8
	var wg sync.WaitGroup
	started := make(chan struct{}, streams)
	for i := 0; i < streams; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"m","stream":true,"max_tokens":200}`))
			if err != nil {
				started <- struct{}{}
				return
			}
			started <- struct{}{}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	for i := 0; i < streams; i++ {
		<-started
	}
	time.Sleep(100 * time.Millisecond)
	begin := time.Now()
	prog.cancel()
	// Events, not times: readiness fails first, then (after drain_delay)
	// the listener closes; a busy machine may take longer for each.
	for deadline := time.Now().Add(30 * time.Second); status(t, "GET", "http://"+admin+"/readyz", "") != 503; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("/readyz never turned 503 while draining")
		}
	}
	if got := status(t, "GET", "http://"+admin+"/healthz", ""); got != 200 {
		t.Errorf("/healthz while draining: %d, want 200", got)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", listen, time.Second)
		if err != nil {
			break
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("the listener still accepts connections long after drain_delay")
		}
	}
	if d := time.Since(begin); d < 300*time.Millisecond {
		t.Errorf("the listener closed %v after the signal, before drain_delay (300ms)", d)
	}
	prog.wait()
	took := time.Since(begin)
	wg.Wait()
	if took < 900*time.Millisecond {
		t.Errorf("stopped after %v: before drain_delay + drain_timeout", took)
	}
	lines := logLines(t, logPath)
	if len(lines) != streams {
		t.Fatalf("%d log lines for %d streams", len(lines), streams)
	}
	for _, l := range lines {
		if l["outcome"] != "shutdown" || l["ttft_ms"] == nil {
			t.Errorf("cut stream's record: %v", l)
		}
	}
}

// Streams that end within drain_timeout finish untouched.
func TestDrainLetsStreamsFinish(t *testing.T) {
	up := startBackend(t, 10*time.Millisecond)
	listen := freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	prog := startRun(t, []string{"-upstream", up, "-listen", listen, "-admin", "", "-access-log", logPath})
	waitUp(t, "http://"+listen+"/v1/models")
	var wg sync.WaitGroup
	bodies := make(chan string, 4)
	started := make(chan struct{}, 4)
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
				strings.NewReader(`{"model":"m","stream":true,"max_tokens":30}`))
			started <- struct{}{} // in flight (or failed): the drain may begin
			if err != nil {
				bodies <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			bodies <- string(b)
		}()
	}
	for range 4 {
		<-started
	}
	prog.cancel()
	wg.Wait()
	close(bodies)
	for b := range bodies {
		if !strings.HasSuffix(b, "data: [DONE]\n\n") {
			t.Errorf("a stream cut by a drain with time to spare: %q", b)
		}
	}
	prog.wait()
	n := 0
	for _, l := range logLines(t, logPath) {
		if l["path"] == "/v1/chat/completions" {
			n++
			if l["outcome"] != "ok" {
				t.Errorf("record: %v", l)
			}
		}
	}
	if n != 4 {
		t.Fatalf("%d stream records, want 4", n)
	}
}

// The admin token guards every endpoint but /healthz and /readyz; the
// access log follows a rotation on SIGUSR1 and on POST /-/reopen without
// losing a line.
func TestAdminTokenAndLogReopen(t *testing.T) {
	up := startBackend(t, time.Millisecond)
	listen, admin := freeAddr(t), freeAddr(t)
	dir := t.TempDir()
	logPath := filepath.Join(dir, "access.log")
	tokPath := filepath.Join(dir, "token")
	const token = "test-admin-token-0123456789"
	os.WriteFile(tokPath, []byte(token+"\n"), 0o600)
	cfg := writeFile(t, "upstream: "+up+"\nadmin:\n  listen: "+admin+"\n  token_file: "+tokPath+"\n")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-access-log", logPath})
	waitUp(t, "http://"+admin+"/healthz")

	for _, c := range []struct {
		method, path, token string
		want                int
	}{
		{"GET", "/healthz", "", 200},
		{"GET", "/readyz", "", 200},
		{"GET", "/metrics", "", 401},
		{"GET", "/metrics", "wrong-token-0123456789", 401},
		{"GET", "/metrics", token, 200},
		{"GET", "/debug/pprof/cmdline", "", 401},
		{"GET", "/debug/pprof/cmdline", token, 200},
		{"POST", "/-/reload", "", 401},
		{"POST", "/-/reopen", "", 401},
		{"POST", "/-/reload", token, 200},
		// The dashboard's page and assets hold no data and load without
		// the token; its data does not.
		{"GET", "/", "", 200},
		{"GET", "/dashboard/app.js", "", 200},
		{"GET", "/dashboard/vendor/uPlot.iife.min.js", "", 200},
		{"GET", "/dashboard/../../go.mod", "", 401}, // normalised to /go.mod: not an asset
		{"GET", "/dashboard/..%2f..%2fgo.mod", "", 401},
		{"GET", "/dashboard/nope.js", "", 404},
		{"GET", "/stats", "", 401},
		{"GET", "/stats/timeline", "", 401},
		{"GET", "/stats", token, 200},
		{"GET", "/stats/timeline", token, 200},
	} {
		if got := status(t, c.method, "http://"+admin+c.path, c.token); got != c.want {
			t.Errorf("%s %s with token %q: %d, want %d", c.method, c.path, c.token, got, c.want)
		}
	}

	send := func(n int) {
		for i := 0; i < n; i++ {
			if got := status(t, "GET", "http://"+listen+"/v1/models", ""); got != 200 {
				t.Fatalf("request: %d", got)
			}
		}
	}
	waitLines := func(path string, n int) {
		deadline := time.Now().Add(time.Minute)
		for len(logLines(t, path)) < n && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
	}
	send(5)
	waitLines(logPath, 5)
	os.Rename(logPath, logPath+".1")
	syscall.Kill(os.Getpid(), syscall.SIGUSR1)
	deadline := time.Now().Add(time.Minute)
	for {
		if _, err := os.Stat(logPath); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	send(3)
	waitLines(logPath, 3)
	os.Rename(logPath, logPath+".2")
	if got := status(t, "POST", "http://"+admin+"/-/reopen", token); got != 200 {
		t.Fatalf("POST /-/reopen: %d", got)
	}
	send(2)
	prog.stop()
	if a, b, c := len(logLines(t, logPath+".1")), len(logLines(t, logPath+".2")), len(logLines(t, logPath)); a != 5 || b != 3 || c != 2 {
		t.Fatalf("lines per file: %d %d %d, want 5 3 2", a, b, c)
	}
}

// Reloads under load lose no count: 3,000 requests across 21 reloads are
// 3,000 in tokentap_requests_total and 3,000 access-log lines, including
// the requests in flight at each reload.
func TestReloadUnderLoadCountsExactly(t *testing.T) {
	wait.Long(t, "reloads under load")
	up := startBackend(t, time.Millisecond)
	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	cfg := writeFile(t, "routes:\n  - name: chat\n    prefix: /v1/\n    upstream: "+up+"\nmodels:\n  allow: [m]\n")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", logPath})
	waitUp(t, "http://"+admin+"/healthz")
	// Series live for the process: other tests in it counted too.
	before := requestsCounted(t, admin)
	const total, workers, reloads = 3000, 6, 21
	var sent sync.WaitGroup
	jobs := make(chan int)
	var mu sync.Mutex
	failed := 0
	for w := 0; w < workers; w++ {
		sent.Add(1)
		go func() {
			defer sent.Done()
			for i := range jobs {
				body := `{"model":"m","max_tokens":2}`
				if i%3 == 0 {
					body = `{"model":"m","stream":true,"max_tokens":3}`
				}
				resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					mu.Lock()
					failed++
					mu.Unlock()
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	for i := 0; i < total; i++ {
		if i%(total/reloads) == total/reloads/2 {
			if got := status(t, "POST", "http://"+admin+"/-/reload", ""); got != 200 {
				t.Fatalf("reload: %d", got)
			}
		}
		jobs <- i
	}
	close(jobs)
	sent.Wait()
	if failed > 0 {
		t.Fatalf("%d requests failed", failed)
	}
	// A record is written once the client acknowledged its response's
	// last bytes (a delayed ACK can take 40 ms): wait for the last ones,
	// never past what was sent.
	waitSeries(t, admin, "tokentap_requests_total{", before+total)
	counted := requestsCounted(t, admin) - before
	prog.stop()
	if counted != total {
		t.Errorf("tokentap_requests_total = %d after %d requests and %d reloads", counted, total, reloads)
	}
	if n := len(logLines(t, logPath)); n != total {
		t.Errorf("%d access-log lines for %d requests", n, total)
	}
}

// requestsCounted sums tokentap_requests_total on the admin listener.
func requestsCounted(t *testing.T, admin string) int {
	return seriesValue(t, admin, "tokentap_requests_total{")
}

// waitSeries waits until the series reach want (an event: a minute is a
// hang, not a slow machine).
func waitSeries(t *testing.T, admin, prefix string, want int) {
	t.Helper()
	for deadline := time.Now().Add(time.Minute); seriesValue(t, admin, prefix) < want; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not reach %d", prefix, want)
		}
	}
}

// seriesValue sums the exposed series whose line starts with prefix (a
// whole series name with labels matches one).
func seriesValue(t *testing.T, admin, prefix string) int {
	t.Helper()
	resp, err := http.Get("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	text, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	counted := 0
	for _, line := range strings.Split(string(text), "\n") {
		if strings.HasPrefix(line, prefix) {
			var n int
			fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &n)
			counted += n
		}
	}
	return counted
}

// The process log says what an operator needs: the drain's durations with
// their units, one line on exit; the admission store's address and error
// when it stops answering (a store that does not answer at start).
func TestLogsThatHelp(t *testing.T) {
	up := startMockllm(t, mockllm.Options{TokenGap: time.Millisecond})
	cfg := writeFile(t, fmt.Sprintf(`routes:
  - {name: chat, prefix: /, upstream: %q}
drain_timeout: 7s
tenants:
  - {name: a, keys: [key-a-0123456789abcdef]}
admission:
  store: {redis: {addr: %q}}
`, up, deadAddr(t)))
	listen, admin := freeAddr(t), freeAddr(t)
	cmd := exec.Command(os.Args[0], "-config", cfg, "-listen", listen, "-admin", admin, "-access-log", "")
	cmd.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waitUp(t, "http://"+admin+"/healthz")
	_ = cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	lines := map[string]map[string]any{}
	for _, l := range strings.Split(strings.TrimSpace(stderr.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("a log line that is not JSON: %q", l)
		}
		lines[fmt.Sprint(m["msg"])] = m
	}
	if d := lines["draining"]; d == nil || d["drain_timeout"] != "7s" || d["drain_delay"] != "0s" {
		t.Errorf("the drain's line: %v", d)
	}
	if s := lines["tokentap stopped"]; s == nil || s["uptime"] == nil {
		t.Errorf("no line on exit:\n%s", stderr.String())
	}
	var store map[string]any
	for msg, m := range lines {
		if strings.HasPrefix(msg, "admission store does not answer") {
			store = m
		}
	}
	if store == nil || store["addr"] == "" || store["error"] == nil {
		t.Errorf("the store's line names no address or error: %v\n%s", store, stderr.String())
	}
}

// deadAddr is a loopback address where nothing listens.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}
