package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"io"
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
	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// configs/production.yaml works as the README shows it: the file as it
// stands, its addresses and paths replaced by the test's (a real Redis
// with a password, an OTLP receiver, certificates, the key digests of two
// keys), run as a process: tokentap -check passes it; a client over TLS
// with team-a's key is served and recorded, one with a key of no tenant
// gets 401; the probes answer without the admin token, /metrics only with
// it; the tenant's counts are in Redis; the spans reach the receiver.
func TestProductionConfig(t *testing.T) {
	wait.Long(t, "the production config's TLS, Redis and OTel receiver")
	raw, err := os.ReadFile("../../configs/production.yaml")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ca := tlstest.NewCA(t, "front")
	cert, key := tlstest.Files(t, ca.Issue(t, false))
	r := redistest.StartWithPassword(t, "redis-secret-0123")
	rcv := startReceiver(t, false)
	up := startMockllm(t, mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond})
	listen, admin := freeAddr(t), freeAddr(t)
	const keyA, keyB = "team-a-key-0123456789abcdef", "team-b-key-0123456789abcdef"
	digest := func(k string) string { s := sha256.Sum256([]byte(k)); return hex.EncodeToString(s[:]) }
	cfg := strings.NewReplacer(
		"listen: :8443", "listen: "+listen,
		"listen: :9090", "listen: "+admin,
		"/etc/tokentap/admin-token", write("admin-token", "admin-token-0123456789abcdef\n"),
		"/etc/tokentap/tls/tls.crt", cert,
		"/etc/tokentap/tls/tls.key", key,
		"http://vllm:8000", up,
		strings.Repeat("0", 64), digest(keyA),
		strings.Repeat("1", 64), digest(keyB),
		`"redis:6379"`, `"`+r.Addr+`"`,
		"/etc/tokentap/redis-password", write("redis-password", "redis-secret-0123\n"),
		"http://otel-collector:4318", rcv.url,
	).Replace(string(raw))
	path := write("tokentap.yaml", cfg)

	check := exec.Command(os.Args[0], "-config", path, "-check")
	check.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
	if out, err := check.CombinedOutput(); err != nil || !strings.Contains(string(out), "config ok") {
		t.Fatalf("tokentap -check: %v\n%s", err, out)
	}
	cmd := exec.Command(os.Args[0], "-config", path)
	cmd.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
	var logs lockedBuffer // written by the command's copying goroutine, read here
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	waitUp(t, "http://"+admin+"/healthz")
	if code := status(t, "GET", "http://"+admin+"/readyz", ""); code != 200 {
		t.Fatalf("/readyz without a token: %d", code)
	}
	if code := status(t, "GET", "http://"+admin+"/metrics", ""); code != 401 {
		t.Fatalf("/metrics without the token: %d", code)
	}
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}, Timeout: 10 * time.Second}
	chat := func(key string) (int, string) {
		req, _ := http.NewRequestWithContext(context.Background(), "POST", "https://"+listen+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := chat(keyA); code != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("team-a over TLS: %d %s\n%s", code, body, logs.String())
	}
	if code, _ := chat("no-tenant-has-this-key-0123"); code != 401 {
		t.Fatalf("an unknown key: %d", code)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		keys, _ := r.Client().Keys(context.Background(), "tokentap:t:team-a*").Result()
		rcv.mu.Lock()
		spans := len(rcv.spans)
		rcv.mu.Unlock()
		if len(keys) > 0 && spans > 0 && strings.Contains(logs.String(), `"tenant":"team-a"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s: %d Redis keys of team-a, %d spans received, the access log:\n%s", len(keys), spans, logs.String())
		}
	}
}

// lockedBuffer is a strings.Builder safe to write from one goroutine and
// read from another.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
