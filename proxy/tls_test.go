package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
)

// startTLSProxy runs the proxy with TLS on its listener.
func startTLSProxy(t *testing.T, upstream string, cfg *tls.Config) *testProxy {
	t.Helper()
	return serveProxy(t, Config{Routes: []Route{{Name: "default", Prefix: "/", Upstream: upstream, Timeouts: DefaultTimeouts}}}, Options{}, cfg)
}

// sseSchedule is an upstream that streams n chunks, the first after
// first, then one per gap.
func sseSchedule(n int, first, gap time.Duration) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		flush(w)
		next := time.Now().Add(first)
		for i := range n {
			time.Sleep(time.Until(next))
			io.WriteString(w, chatChunk(fmt.Sprintf("t%d", i)))
			flush(w)
			next = time.Now().Add(gap)
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}
}

// exchangeOn sends a streamed chat request on c, after wait, and returns
// the response body as the client read it.
func exchangeOn(t *testing.T, c net.Conn, br *bufio.Reader, wait time.Duration) string {
	t.Helper()
	time.Sleep(wait)
	if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"model":"m","stream":true}`)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	return string(b)
}

// Over TLS a stream reaches the client byte for byte, and its record says
// what it says over a plain connection: the same events and tokens, a
// time to first token from the request (not from the handshake, not from
// an idle wait before it), the client's side from TCP_INFO with every
// byte acknowledged.
func TestTLSClientMeasuredAsPlain(t *testing.T) {
	const first, gap, n = 60 * time.Millisecond, 5 * time.Millisecond, 20
	up := startUpstream(t, sseSchedule(n, first, gap))
	ca := tlstest.NewCA(t, "tokentap test CA")
	tp := startTLSProxy(t, up.URL, &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}})
	plain := startProxy(t, up.URL, nil)

	tc, err := tls.Dial("tcp", tp.addr, &tls.Config{RootCAs: ca.Pool, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	pc, err := net.Dial("tcp", plain.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	tbr, pbr := bufio.NewReader(tc), bufio.NewReader(pc)
	for i, wait := range []time.Duration{150 * time.Millisecond, 150 * time.Millisecond} {
		// The first request comes 150 ms after the handshake, the second
		// 150 ms after the first response: neither wait is the request's.
		tb := exchangeOn(t, tc, tbr, wait)
		pb := exchangeOn(t, pc, pbr, wait)
		if tb != pb || !strings.HasSuffix(tb, "data: [DONE]\n\n") {
			t.Fatalf("request %d: bodies differ over TLS:\n%q\n%q", i, tb, pb)
		}
		tr, pr := tp.rec.next(t), plain.rec.next(t)
		if tr.Outcome != metrics.OutcomeOK || tr.Events != n || tr.Events != pr.Events || tr.OutputTokens != pr.OutputTokens {
			t.Fatalf("request %d: TLS record %+v, plain %+v", i, tr, pr)
		}
		for _, r := range []metrics.Record{tr, pr} {
			if r.TTFT < first || r.TTFT > first+100*time.Millisecond || r.E2E < r.TTFT+time.Duration(n-1)*gap {
				t.Errorf("request %d: ttft %v e2e %v (first token sent after %v)", i, r.TTFT, r.E2E, first)
			}
			if r.ClientTTFT < r.TTFT || r.ClientTTFT > r.TTFT+50*time.Millisecond || r.ClientRTT < 0 {
				t.Errorf("request %d: client ttft %v against ttft %v, rtt %v", i, r.ClientTTFT, r.TTFT, r.ClientRTT)
			}
			if r.BytesWire <= r.BytesOut || r.BytesAcked != r.BytesWire || r.Unacked {
				t.Errorf("request %d: wire %d acked %d out %d unacked %v", i, r.BytesWire, r.BytesAcked, r.BytesOut, r.Unacked)
			}
			if r.Overhead < 0 || r.Overhead > 30*time.Millisecond {
				t.Errorf("request %d: overhead %v", i, r.Overhead)
			}
		}
	}
}

// mTLS: a client with a certificate from the configured CA is served; one
// without a certificate, or with one from another CA, is refused in the
// handshake, and nothing reaches the upstream.
func TestTLSClientCertificates(t *testing.T) {
	var calls int
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		calls++
		io.WriteString(w, `{"ok":true}`)
	})
	ca, other := tlstest.NewCA(t, "clients"), tlstest.NewCA(t, "strangers")
	serverCA := tlstest.NewCA(t, "server")
	tp := startTLSProxy(t, up.URL, &tls.Config{Certificates: []tls.Certificate{serverCA.Issue(t, false)},
		ClientCAs: ca.Pool, ClientAuth: tls.RequireAndVerifyClientCert})
	try := func(certs []tls.Certificate) error {
		c, err := tls.Dial("tcp", tp.addr, &tls.Config{RootCAs: serverCA.Pool, ServerName: "localhost", Certificates: certs})
		if err != nil {
			return err
		}
		defer c.Close()
		if _, err := io.WriteString(c, postJSON("/v1/embeddings", `{}`)); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}
	if err := try([]tls.Certificate{ca.Issue(t, true)}); err != nil {
		t.Fatalf("a client of the right CA: %v", err)
	}
	if err := try(nil); err == nil {
		t.Fatal("a client without a certificate was served")
	}
	if err := try([]tls.Certificate{other.Issue(t, true)}); err == nil {
		t.Fatal("a client of another CA was served")
	}
	if calls != 1 {
		t.Fatalf("%d requests reached the upstream, want 1", calls)
	}
	tp.rec.next(t)
	tp.rec.none(t)
}

// A TLS client that leaves during a long prefill (its close_notify, then
// its FIN) cancels the request as a plain one does.
func TestTLSClientLeavesDuringPrefill(t *testing.T) {
	upstreamGone, prefilling := make(chan struct{}), make(chan struct{})
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		close(prefilling)
		select {
		case <-r.Context().Done():
			close(upstreamGone)
		case <-time.After(10 * time.Second):
		}
	})
	ca := tlstest.NewCA(t, "ca")
	tp := startTLSProxy(t, up.URL, &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}})
	c, err := tls.Dial("tcp", tp.addr, &tls.Config{RootCAs: ca.Pool, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"model":"m","stream":true}`)); err != nil {
		t.Fatal(err)
	}
	select { // the request is at the upstream
	case <-prefilling:
	case <-time.After(10 * time.Second):
		t.Fatal("the request never reached the upstream")
	}
	c.Close()
	select {
	case <-upstreamGone:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not cancelled")
	}
	if r := tp.rec.next(t); r.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("outcome %s", r.Outcome)
	}
}

// startTLSUpstream runs an https upstream with a certificate of ca, asking
// for client certificates of clients when it is not nil.
func startTLSUpstream(t *testing.T, ca, clients *tlstest.CA, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	s := httptest.NewUnstartedServer(h)
	s.TLS = &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}}
	if clients != nil {
		s.TLS.ClientCAs, s.TLS.ClientAuth = clients.Pool, tls.RequireAndVerifyClientCert
	}
	s.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes are the test's
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}

func statusThrough(t *testing.T, tp *testProxy) int {
	t.Helper()
	resp, err := http.Post(tp.url+"/v1/embeddings", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	tp.rec.next(t)
	return resp.StatusCode
}

// An upstream with a certificate of a private CA: refused with the
// system's roots, served with the route's ca_file; server_name is what the
// certificate is checked against; tokentap presents its client
// certificate to an upstream that asks for one.
func TestUpstreamTLSPrivateCAAndClientCertificate(t *testing.T) {
	ok := func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"data":[]}`) }
	ca, clients := tlstest.NewCA(t, "backends"), tlstest.NewCA(t, "gateways")
	up := startTLSUpstream(t, ca, nil, ok)
	mtls := startTLSUpstream(t, ca, clients, ok)
	certFile, keyFile := tlstest.Files(t, clients.Issue(t, true))
	strangerCert, strangerKey := tlstest.Files(t, tlstest.NewCA(t, "strangers").Issue(t, true))
	for _, c := range []struct {
		name string
		url  string
		tls  *UpstreamTLS
		want int
	}{
		{"system roots", up.URL, nil, 502},
		{"private CA", up.URL, &UpstreamTLS{CAFile: ca.File(t)}, 200},
		{"another name", up.URL, &UpstreamTLS{CAFile: ca.File(t), ServerName: "backend.example"}, 502},
		{"the certificate's name", up.URL, &UpstreamTLS{CAFile: ca.File(t), ServerName: "localhost"}, 200},
		{"unverified", up.URL, &UpstreamTLS{InsecureSkipVerify: true}, 200},
		{"mTLS without a certificate", mtls.URL, &UpstreamTLS{CAFile: ca.File(t)}, 502},
		{"mTLS with the wrong certificate", mtls.URL, &UpstreamTLS{CAFile: ca.File(t), CertFile: strangerCert, KeyFile: strangerKey}, 502},
		{"mTLS", mtls.URL, &UpstreamTLS{CAFile: ca.File(t), CertFile: certFile, KeyFile: keyFile}, 200},
	} {
		tp := startProxy(t, c.url, func(cfg *Config) { cfg.Routes[0].TLS = c.tls })
		if got := statusThrough(t, tp); got != c.want {
			t.Errorf("%s: status %d, want %d", c.name, got, c.want)
		}
	}
	bad := Config{Routes: []Route{{Name: "r", Prefix: "/", Upstream: up.URL, Timeouts: DefaultTimeouts, TLS: &UpstreamTLS{CAFile: "/nonexistent/ca.pem"}}}}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "routes[0].tls.ca_file") {
		t.Errorf("a missing ca_file: %v", err)
	}
	bad.Routes[0].TLS = &UpstreamTLS{CertFile: certFile}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "routes[0].tls.cert_file") {
		t.Errorf("a cert_file without key_file: %v", err)
	}
	bad.Routes[0].Upstream, bad.Routes[0].TLS = "http://127.0.0.1:1", &UpstreamTLS{InsecureSkipVerify: true}
	if err := bad.Validate(); err == nil || !strings.Contains(err.Error(), "no https upstream") {
		t.Errorf("tls on a plain route: %v", err)
	}
}

// connectProxy is a forward proxy that answers CONNECT for the names in
// hosts (a name → an address), keeping the requests' lines and
// credentials.
type connectProxy struct {
	addr  string
	mu    sync.Mutex
	seen  []string
	creds []string
}

func startConnectProxy(t *testing.T, hosts map[string]string) *connectProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cp := &connectProxy{addr: ln.Addr().String()}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil || req.Method != "CONNECT" {
					return
				}
				cp.mu.Lock()
				cp.seen, cp.creds = append(cp.seen, req.Host), append(cp.creds, req.Header.Get("Proxy-Authorization"))
				cp.mu.Unlock()
				to, ok := hosts[req.Host]
				if !ok {
					io.WriteString(c, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
					return
				}
				up, err := net.Dial("tcp", to)
				if err != nil {
					io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
					return
				}
				defer up.Close()
				io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n")
				go io.Copy(up, c)
				io.Copy(c, up)
			}()
		}
	}()
	return cp
}

// HTTPS_PROXY: an upstream whose name only the forward proxy knows is
// reached through its CONNECT tunnel, with the proxy URL's credentials;
// NO_PROXY sends it direct (and its name does not resolve here).
func TestUpstreamThroughHTTPSProxy(t *testing.T) {
	ca := tlstest.NewCA(t, "backends")
	up := startTLSUpstream(t, ca, nil, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{"data":[]}`) })
	fwd := startConnectProxy(t, map[string]string{"backend.invalid:443": up.Listener.Addr().String()})
	t.Setenv("HTTPS_PROXY", "http://gw:s3cret@"+fwd.addr)
	t.Setenv("NO_PROXY", "")
	route := func(cfg *Config) { cfg.Routes[0].TLS = &UpstreamTLS{CAFile: ca.File(t), ServerName: "localhost"} }
	tp := startProxy(t, "https://backend.invalid", route)
	for range 2 {
		if got := statusThrough(t, tp); got != 200 {
			t.Fatalf("through the forward proxy: status %d", got)
		}
	}
	fwd.mu.Lock()
	seen, creds := slices.Clone(fwd.seen), slices.Clone(fwd.creds)
	fwd.mu.Unlock()
	if len(seen) != 1 || seen[0] != "backend.invalid:443" || creds[0] != "Basic "+base64.StdEncoding.EncodeToString([]byte("gw:s3cret")) {
		t.Fatalf("the forward proxy saw %q with %q (one tunnel, kept alive, wanted)", seen, creds)
	}
	t.Setenv("NO_PROXY", "backend.invalid")
	direct := startProxy(t, "https://backend.invalid", route)
	if got := statusThrough(t, direct); got != 502 {
		t.Fatalf("with NO_PROXY: status %d, want 502 (a name only the proxy knows)", got)
	}
	fwd.mu.Lock()
	defer fwd.mu.Unlock()
	if len(fwd.seen) != 1 {
		t.Fatalf("NO_PROXY went through the forward proxy: %q", fwd.seen)
	}
}

// A renewed certificate is served without a restart: when its files
// change (Watch), or on Reload; files that cannot be read keep the one in
// use.
func TestServerTLSServesRenewedCertificates(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {})
	ca := tlstest.NewCA(t, "ca")
	certFile, keyFile := tlstest.Files(t, ca.Issue(t, false))
	files := ServerTLSFiles{CertFile: certFile, KeyFile: keyFile}
	st, err := NewServerTLS(files)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var failures, renewals atomic.Int32
	go st.Watch(ctx, 20*time.Millisecond, func(err error) {
		if err != nil {
			failures.Add(1)
		} else {
			renewals.Add(1)
		}
	})
	tp := startTLSProxy(t, up.URL, st.Config())
	first := tlstest.Serial(t, tp.addr)

	// Renewed in place (as cert-manager and a Kubernetes secret do).
	renewedCert, renewedKey := tlstest.Files(t, ca.Issue(t, false))
	for _, mv := range [][2]string{{renewedCert, certFile}, {renewedKey, keyFile}} {
		if err := os.Rename(mv[0], mv[1]); err != nil {
			t.Fatal(err)
		}
	}
	var second string
	waitFor(t, func() error {
		if second = tlstest.Serial(t, tp.addr); second == first {
			return errors.New("the renewed certificate is not served")
		}
		return nil
	})
	if serial, _, notAfter := st.Serving(); renewals.Load() == 0 || serial != second || notAfter.IsZero() {
		t.Fatalf("renewal told %d times; serving %s (until %v), the listener %s", renewals.Load(), serial, notAfter, second)
	}

	// Broken files: the certificate in use stays, and the failure is told.
	if err := os.WriteFile(certFile, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, func() bool { return failures.Load() > 0 })
	if failures.Load() == 0 || tlstest.Serial(t, tp.addr) != second {
		t.Fatalf("broken files: %d failures told, serving %s", failures.Load(), tlstest.Serial(t, tp.addr))
	}

	// Reload with other files.
	otherCert, otherKey := tlstest.Files(t, ca.Issue(t, false))
	if err := st.Reload(ServerTLSFiles{CertFile: otherCert, KeyFile: otherKey}); err != nil {
		t.Fatal(err)
	}
	if third := tlstest.Serial(t, tp.addr); third == second || third == first {
		t.Fatal("Reload did not serve the new files")
	}
	if err := st.Reload(ServerTLSFiles{CertFile: certFile, KeyFile: keyFile}); err == nil {
		t.Fatal("Reload took broken files")
	}
}

// A plain HTTP request sent to the TLS port is answered 400 in plain text,
// saying to use https (it got an empty reply); it reaches no upstream and
// has no record, as a failed handshake.
func TestPlainHTTPOnTheTLSPort(t *testing.T) {
	calls := 0
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { calls++ })
	ca := tlstest.NewCA(t, "server")
	tp := startTLSProxy(t, up.URL, &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}})
	c, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{}`))
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 400 || !strings.Contains(string(body), "plain_http_to_tls_port") || !resp.Close {
		t.Fatalf("%d %q %s", resp.StatusCode, resp.Header, body)
	}
	if calls != 0 {
		t.Fatal("the plain request reached the upstream")
	}
	tp.rec.none(t)
}
