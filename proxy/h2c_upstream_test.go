package proxy

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// h2cBackend is Go's HTTP/2 server without TLS (h2c with prior
// knowledge) running h; it fails a request that came in HTTP/1.x, and
// counts the connections its requests came on.
func h2cBackend(t *testing.T, h http.Handler) (url string, conns func() int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	seen := map[string]bool{}
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	srv := &http.Server{Protocols: &protos, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor != 2 {
			http.Error(w, "h2c only", http.StatusHTTPVersionNotSupported)
			return
		}
		mu.Lock()
		seen[r.RemoteAddr] = true
		mu.Unlock()
		h.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String(), func() int { mu.Lock(); defer mu.Unlock(); return len(seen) }
}

// A backend spoken to in h2c (upstreams[].protocol: h2c): its streamed
// responses reach HTTP/1.1 and HTTP/2 clients byte for byte, recorded as
// any other's; 20 requests at once share its connection; a client that
// leaves resets its stream at the backend; a backend that says nothing
// past the first-byte timeout fails the request as a timeout.
func TestH2CBackend(t *testing.T) {
	up := &echoStream{n: 6, gap: 3 * time.Millisecond}
	url, conns := h2cBackend(t, up)
	tp := startProxy(t, url, func(c *Config) {
		c.Routes[0].Upstream = ""
		c.Routes[0].Upstreams = []Upstream{{Name: "h2c", URL: url, Weight: 1, Protocol: "h2c"}}
	})
	want := func(body string) string {
		var b strings.Builder
		for i := range up.n {
			b.WriteString(chatChunk(fmt.Sprintf("%s-%d", body, i)))
		}
		return b.String() + "data: [DONE]\n\n"
	}
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			client := http.DefaultClient
			if i%2 == 1 {
				client = h2cClient()
			}
			body := fmt.Sprintf("b%d", i)
			if _, got := post(t, client, tp.url, body); got != want(body) {
				t.Errorf("request %d: %q", i, got)
			}
		})
	}
	wg.Wait()
	for range 20 {
		r := tp.rec.next(t)
		if r.Outcome != metrics.OutcomeOK || r.Events != up.n || r.Upstream != "h2c" || r.TTFT <= 0 || r.UpstreamTTFB < 0 {
			t.Fatalf("record: %s, %d events, upstream %q, ttft %v, ttfb %v", r.Outcome, r.Events, r.Upstream, r.TTFT, r.UpstreamTTFB)
		}
	}
	if n, most := conns(), up.most.Load(); n > 2 || most < 2 {
		t.Errorf("20 requests at once on %d connections, %d at once at the backend", n, most)
	}

	// A client that leaves: the backend's stream is reset.
	up.n, up.gap = 300, 10*time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "POST", tp.url+"/v1/chat/completions", strings.NewReader("leaves"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 16)); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	waitUntil(t, func() bool { return up.cancelled.Load() == 1 })
	if r := tp.rec.next(t); r.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("the client that left: %s", r.Outcome)
	}
}

// An h2c backend that sends no header within the first-byte timeout
// fails the request as a timeout (504), and one that stops sending
// mid-stream past the idle timeout cuts the stream as one.
func TestH2CBackendTimeouts(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	url, _ := h2cBackend(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/silent" {
			<-hold
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("one"))
		flush(w)
		<-hold
	}))
	tp := startProxy(t, url, func(c *Config) {
		c.Routes[0].Upstream = ""
		c.Routes[0].Upstreams = []Upstream{{Name: "h2c", URL: url, Weight: 1, Protocol: "h2c"}}
		c.Routes[0].Timeouts.FirstByte = 200 * time.Millisecond
		c.Routes[0].Timeouts.Idle = 300 * time.Millisecond
	})
	resp, err := http.Post(tp.url+"/v1/silent", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if r := tp.rec.next(t); resp.StatusCode != http.StatusGatewayTimeout || r.Outcome != metrics.OutcomeUpstreamTimeout {
		t.Fatalf("a silent h2c backend: status %d, outcome %s", resp.StatusCode, r.Outcome)
	}
	resp, err = http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if r := tp.rec.next(t); !strings.HasPrefix(string(b), chatChunk("one")) || r.Outcome != metrics.OutcomeUpstreamTimeout || r.Events != 1 {
		t.Fatalf("an h2c backend silent mid-stream: %q, outcome %s, %d events", b, r.Outcome, r.Events)
	}
}

// A protocol an upstream cannot be spoken to in is refused, the field
// named.
func TestH2CBackendConfig(t *testing.T) {
	for _, c := range []struct{ url, protocol, want string }{
		{"https://127.0.0.1:1", "h2c", "routes[0].upstreams[0].protocol"},
		{"http://127.0.0.1:1", "h3", "routes[0].upstreams[0].protocol"},
	} {
		_, err := New(Config{Routes: []Route{{Name: "r", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "a", URL: c.url, Weight: 1, Protocol: c.protocol}}}}}, Options{})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s over %s: %v, want an error naming %s", c.protocol, c.url, err, c.want)
		}
	}
	for _, p := range []string{"", "http/1.1", "h2c"} {
		px, err := New(Config{Routes: []Route{{Name: "r", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "a", URL: "http://127.0.0.1:1", Weight: 1, Protocol: p}}}}}, Options{})
		if err != nil {
			t.Errorf("protocol %q: %v", p, err)
			continue
		}
		px.Close()
	}
}
