package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// TestUpstreamCredentialFromAFile: tokentap, the binary as a user runs it,
// with a tenant known by its key and the backend's key read from a file
// (headers: {Authorization: "Bearer ${file:...}"}). The backend sees its
// own key on 3 requests of 3 and never the tenant's; after the file
// changes and a reload, the next request carries the new key; neither
// key, nor the tenant's, is in any line tokentap logged (the process log
// and the access log).
func TestUpstreamCredentialFromAFile(t *testing.T) {
	const tenantKey = "tenant-key-0123456789abcdef"
	backendKeys := []string{"sk-backend-one-5f2a9c", "sk-backend-two-7d4e1b"}
	var mu sync.Mutex
	var seen []string // the Authorization and x-api-key the backend got
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		mu.Lock()
		seen = append(seen, r.Header.Get("Authorization")+"|"+r.Header.Get("X-Api-Key"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"content":"hi"}}]}`)
	}))
	defer backend.Close()
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "backend-key")
	if err := os.WriteFile(keyFile, []byte(backendKeys[0]+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	listen, admin := freeAddr(t), freeAddr(t)
	cfg := filepath.Join(dir, "tokentap.yaml")
	conf := "listen: " + listen + "\nadmin: " + admin + "\naccess_log: \"-\"\nroutes:\n  - name: chat\n    prefix: /\n    upstream: " + backend.URL +
		"\n    headers: {Authorization: \"Bearer ${file:" + keyFile + "}\"}\n" +
		"tenants:\n  - name: team\n    keys: [" + tenantKey + "]\n"
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-config", cfg)
	cmd.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
	var logs lockedBuffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			_ = cmd.Process.Signal(syscall.SIGTERM)
			_ = cmd.Wait()
		}
	}
	defer stop()
	waitUp(t, "http://"+admin+"/healthz")
	chat := func() {
		t.Helper()
		req, _ := http.NewRequest("POST", "http://"+listen+"/v1/chat/completions", strings.NewReader(`{"model":"m","messages":[]}`))
		req.Header.Set("Authorization", "Bearer "+tenantKey)
		req.Header.Set("X-Api-Key", tenantKey)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("a request with the tenant's key: %d\n%s", resp.StatusCode, logs.String())
		}
	}
	for range 3 {
		chat()
	}
	if err := os.WriteFile(keyFile, []byte(backendKeys[1]+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if code := status(t, "POST", "http://"+admin+"/-/reload", ""); code != 200 {
		t.Fatalf("reload: %d\n%s", code, logs.String())
	}
	chat()
	stop()
	mu.Lock()
	defer mu.Unlock()
	want := []string{"Bearer " + backendKeys[0] + "|", "Bearer " + backendKeys[0] + "|", "Bearer " + backendKeys[0] + "|", "Bearer " + backendKeys[1] + "|"}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") {
		t.Errorf("the backend saw (Authorization|X-Api-Key):\n%s\nwant its own key, never the tenant's:\n%s", strings.Join(seen, "\n"), strings.Join(want, "\n"))
	}
	out := logs.String()
	if !strings.Contains(out, `"tenant":"team"`) {
		t.Fatalf("no access log line of the tenant's requests:\n%s", out)
	}
	for _, secret := range append(backendKeys, tenantKey) {
		if strings.Contains(out, secret) {
			t.Errorf("a log line holds %s:\n%s", secret, out)
		}
	}
}

// TestHeadersFromTheEnvironmentAndFiles: a header's value reads
// ${env:NAME} and ${file:PATH} (trailing line breaks trimmed), several in
// one value; a variable not set, a file not there, a value with a line
// break and a header tokentap sets itself are refused, the field and line
// named and never a value.
func TestHeadersFromTheEnvironmentAndFiles(t *testing.T) {
	t.Setenv("TOKENTAP_TEST_ORG", "org-42")
	key := filepath.Join(t.TempDir(), "key")
	os.WriteFile(key, []byte("sk-from-file\r\n"), 0o600)
	hs, err := headers(map[string]string{"Authorization": "Bearer ${file:" + key + "}", "OpenAI-Organization": "${env:TOKENTAP_TEST_ORG}", "X-Both": "${env:TOKENTAP_TEST_ORG}/${file:" + key + "}"}, "routes[0].headers")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, h := range hs {
		got[h.Name] = h.Value
	}
	if got["Authorization"] != "Bearer sk-from-file" || got["OpenAI-Organization"] != "org-42" || got["X-Both"] != "org-42/sk-from-file" {
		t.Errorf("headers read %v", got)
	}
	t.Setenv("TOKENTAP_TEST_EMPTY_SECRET", "line\nbreak")
	for _, c := range []struct{ value, line, want string }{
		{"${env:TOKENTAP_TEST_NOT_SET_ANYWHERE}", ":6:", "routes[0].headers.Authorization: the environment variable TOKENTAP_TEST_NOT_SET_ANYWHERE is not set"},
		{"${file:/nonexistent/tokentap-key}", ":6:", "routes[0].headers.Authorization: cannot read /nonexistent/tokentap-key"},
		{"${env:TOKENTAP_TEST_EMPTY_SECRET}", ":6:", "routes[0].headers.Authorization: holds a line break or NUL"},
	} {
		path := filepath.Join(t.TempDir(), "tokentap.yaml")
		os.WriteFile(path, []byte("routes:\n  - name: a\n    prefix: /\n    upstream: http://127.0.0.1:1\n    headers:\n      Authorization: \""+c.value+"\"\n"), 0o600)
		_, err := parseFlags([]string{"-config", path, "-check"})
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), c.line) || strings.Contains(err.Error(), "line\nbreak") {
			t.Errorf("%s: %v, want %q at line %s", c.value, err, c.want, c.line)
		}
	}
	path := filepath.Join(t.TempDir(), "tokentap.yaml")
	os.WriteFile(path, []byte("routes:\n  - name: a\n    prefix: /\n    upstream: http://127.0.0.1:1\n    headers: {Host: x}\n"), 0o600)
	if _, err := parseFlags([]string{"-config", path, "-check"}); err == nil || !strings.Contains(err.Error(), "routes[0].headers.Host: is set by tokentap itself") {
		t.Errorf("a Host header: %v", err)
	}
}
