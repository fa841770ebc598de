package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// TLS both ways from the config: clients reach the proxy listener over
// TLS, the admin listener over TLS too, tokentap reaches an upstream of a
// private CA with the route's ca_file; a reload with new certificate files
// serves them without a restart.
func TestTLSBothWaysFromTheConfig(t *testing.T) {
	backends, front, admins := tlstest.NewCA(t, "backends"), tlstest.NewCA(t, "front"), tlstest.NewCA(t, "admin")
	up := httptest.NewUnstartedServer(mockllm.New(mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond}))
	up.TLS = &tls.Config{Certificates: []tls.Certificate{backends.Issue(t, false)}}
	up.StartTLS()
	defer up.Close()

	certFile, keyFile := tlstest.Files(t, front.Issue(t, false))
	adminCert, adminKey := tlstest.Files(t, admins.Issue(t, false))
	listen, adm := freeAddr(t), freeAddr(t)
	config := func(cert, key string) string {
		return fmt.Sprintf(`listen: %s
admin: {listen: %s, tls: {cert_file: %s, key_file: %s}}
access_log: ""
tls: {cert_file: %s, key_file: %s, min_version: "1.3"}
routes:
  - name: chat
    prefix: /
    upstream: %s
    tls: {ca_file: %s}
`, listen, adm, adminCert, adminKey, cert, key, up.URL, backends.File(t))
	}
	cfg := writeFile(t, config(certFile, keyFile))
	r := startRun(t, []string{"-config", cfg})
	defer r.stop()

	adminClient := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: admins.Pool}}}
	var err error
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var resp *http.Response
		if resp, err = adminClient.Get("https://" + adm + "/healthz"); err == nil {
			resp.Body.Close()
			break
		}
	}
	if err != nil {
		t.Fatalf("admin over TLS: %v", err)
	}
	// Plain HTTP gets a plain-text 400 saying so (it read as EOF).
	if resp, err := http.Get("http://" + adm + "/healthz"); err != nil {
		t.Fatalf("plain HTTP to the TLS admin listener: %v", err)
	} else {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(body), "plain_http_to_tls_port") {
			t.Fatalf("plain HTTP to the TLS admin listener: %d %s", resp.StatusCode, body)
		}
	}
	// tokentap stats over TLS with the admin's CA; as host:port (plain) it
	// says to use https.
	var out strings.Builder
	if err := runStats(context.Background(), []string{"-admin", "https://" + adm, "-cacert", admins.File(t)}, &out); err != nil || !strings.Contains(out.String(), "window 5m") {
		t.Fatalf("tokentap stats -cacert over TLS: %v\n%s", err, out.String())
	}
	if err := runStats(context.Background(), []string{"-admin", adm}, &out); err == nil || !strings.Contains(err.Error(), "https://") {
		t.Fatalf("tokentap stats in plain HTTP to a TLS admin: %v", err)
	}

	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: front.Pool}}}
	resp, err := client.Post("https://"+listen+"/v1/chat/completions", "application/json",
		strings.NewReader(`{"model":"m","stream":true,"max_tokens":4,"messages":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "[DONE]") || resp.TLS == nil || resp.TLS.Version != tls.VersionTLS13 {
		t.Fatalf("through TLS both ways: %d %q", resp.StatusCode, body)
	}
	if _, err := tls.Dial("tcp", listen, &tls.Config{RootCAs: front.Pool, MaxVersion: tls.VersionTLS12}); err == nil {
		t.Fatal("min_version 1.3 let a TLS 1.2 client in")
	}

	// A renewed certificate, in new files, on reload.
	first := tlstest.Serial(t, listen)
	newCert, newKey := tlstest.Files(t, front.Issue(t, false))
	if err := os.WriteFile(cfg, []byte(config(newCert, newKey)), 0o600); err != nil {
		t.Fatal(err)
	}
	resp, err = adminClient.Post("https://"+adm+"/-/reload", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("reload: %d", resp.StatusCode)
	}
	if second := tlstest.Serial(t, listen); second == first {
		t.Fatal("the reload did not serve the new certificate")
	}
}

// TLS sections with mistakes are refused, naming the field.
func TestTLSConfigErrors(t *testing.T) {
	ca := tlstest.NewCA(t, "ca")
	cert, key := tlstest.Files(t, ca.Issue(t, false))
	for _, c := range []struct{ yaml, want string }{
		{"tls: {cert_file: " + cert + ", key_file: " + key + ", min_version: \"1.1\"}\n", "tls.min_version"},
		{"tls: {cert_file: " + cert + "}\n", "tls.cert_file"},
		{"tls: {cert_file: " + cert + ", key_file: /nonexistent}\n", "tls.cert_file"},
		{"tls: {cert_file: " + cert + ", key_file: " + key + ", client_ca_file: " + key + "}\n", "tls.client_ca_file"},
		{"admin: {listen: 127.0.0.1:0, tls: {cert_file: " + cert + ", key_file: " + cert + "}}\n", "admin.tls.cert_file"},
		{"admin: {listen: 127.0.0.1:0, tls: {cert: x}}\n", "unknown field cert"},
		{"routes:\n  - {name: a, prefix: /, upstream: \"https://x\", tls: {ca_file: /nonexistent}}\n", "routes[0].tls.ca_file"},
		{"routes:\n  - {name: a, prefix: /, upstream: \"http://x\", tls: {insecure_skip_verify: true}}\n", "no https upstream"},
	} {
		_, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://127.0.0.1:1\n"+c.yaml)})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v, want %q", c.yaml, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "PRIVATE KEY") {
			t.Errorf("an error quotes a file: %v", err)
		}
	}
}

func TestWebSocketRouteConfig(t *testing.T) {
	s, err := parseFlags([]string{"-config", writeFile(t, "routes:\n  - {name: rt, prefix: /v1/realtime, upstream: \"http://x\", websocket: true}\n  - {name: chat, prefix: /, upstream: \"http://y\"}\n")})
	if err != nil {
		t.Fatal(err)
	}
	if !s.proxy.Routes[0].WebSocket || s.proxy.Routes[1].WebSocket {
		t.Fatalf("routes %+v", s.proxy.Routes)
	}
}

// -watch-config: a changed config file (a ConfigMap's update swaps a
// symbolic link) is reloaded without a signal.
func TestWatchConfigReloads(t *testing.T) {
	wait.Long(t, "the config watcher's reloads")
	a := startMockllm(t, mockllm.Options{Model: "backend-a", TokenGap: time.Millisecond})
	b := startMockllm(t, mockllm.Options{Model: "backend-b", TokenGap: time.Millisecond})
	listen, adm := freeAddr(t), freeAddr(t)
	dir := t.TempDir()
	write := func(name, upstream string) string {
		p := dir + "/" + name
		if err := os.WriteFile(p, []byte(fmt.Sprintf("listen: %s\nadmin: %s\naccess_log: \"\"\nupstream: %s\n", listen, adm, upstream)), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	link := dir + "/tokentap.yaml"
	if err := os.Symlink(write("v1.yaml", a), link); err != nil {
		t.Fatal(err)
	}
	r := startRun(t, []string{"-config", link, "-watch-config"})
	defer r.stop()
	waitUp(t, "http://"+adm+"/healthz")
	model := func() string {
		resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json", strings.NewReader(`{"max_tokens":1,"messages":[]}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return string(body)
	}
	if !strings.Contains(model(), "backend-a") {
		t.Fatal("not served by the first config's upstream")
	}
	tmp := dir + "/next"
	if err := os.Symlink(write("v2.yaml", b), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, link); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if strings.Contains(model(), "backend-b") {
			return
		}
	}
	t.Fatal("the changed config was not reloaded")
}
