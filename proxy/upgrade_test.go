package proxy

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
)

// echoServer is a WebSocket server that answers each message with
// "echo: " and the message, on the subprotocol the client offers; a
// request without the right key is refused 403.
func echoServer(t *testing.T) string {
	t.Helper()
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer k" {
			http.Error(w, `{"error":"no key"}`, http.StatusForbidden)
			return
		}
		c, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{"realtime"}})
		if err != nil {
			return
		}
		defer c.CloseNow()
		ctx := context.Background()
		for {
			typ, msg, err := c.Read(ctx)
			if err != nil {
				return
			}
			if err := c.Write(ctx, typ, append([]byte("echo: "), msg...)); err != nil {
				return
			}
		}
	})
	return up.URL
}

func dialWS(t *testing.T, url string, opts *websocket.DialOptions) (*websocket.Conn, *http.Response, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return websocket.Dial(ctx, url, opts)
}

// A route with websocket: true relays the upgrade transparently (the 101
// with the subprotocol, then messages both ways until the client closes)
// and records the bytes each way and the session's length; the
// upstream's refusal reaches the client as it came; a route without it
// answers 400.
func TestWebSocketPassThrough(t *testing.T) {
	up := echoServer(t)
	tp := startProxy(t, up, func(c *Config) { c.Routes[0].WebSocket = true })
	opts := &websocket.DialOptions{Subprotocols: []string{"realtime"}, HTTPHeader: http.Header{"Authorization": {"Bearer k"}}}
	c, resp, err := dialWS(t, "ws://"+tp.addr+"/v1/realtime?model=gpt-realtime", opts)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 101 || c.Subprotocol() != "realtime" {
		t.Fatalf("status %d subprotocol %q", resp.StatusCode, c.Subprotocol())
	}
	ctx := context.Background()
	sent, got := 0, 0
	start := time.Now()
	for i := range 20 {
		msg := fmt.Sprintf(`{"type":"input_audio_buffer.append","n":%d,"audio":"%s"}`, i, strings.Repeat("A", 1000*i))
		if err := c.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
			t.Fatal(err)
		}
		_, b, err := c.Read(ctx)
		if err != nil || string(b) != "echo: "+msg {
			t.Fatalf("message %d: %v %.40q", i, err, b)
		}
		sent, got = sent+len(msg), got+len(b)
		time.Sleep(5 * time.Millisecond)
	}
	c.Close(websocket.StatusNormalClosure, "done")
	lived := time.Since(start)
	r := tp.rec.next(t)
	if r.Status != 101 || r.Outcome != metrics.OutcomeOK || r.Method != "GET" || r.Path != "/v1/realtime" {
		t.Fatalf("record %+v", r)
	}
	// Framing adds a few bytes per message (masked from the client).
	if r.BytesIn < int64(sent) || r.BytesIn > int64(sent)+20*20 || r.BytesOut < int64(got) || r.BytesOut > int64(got)+20*20 {
		t.Errorf("bytes in %d (sent %d) out %d (got %d)", r.BytesIn, sent, r.BytesOut, got)
	}
	if r.E2E < 100*time.Millisecond || r.E2E > lived+time.Second {
		t.Errorf("session length %v, the client's %v", r.E2E, lived)
	}

	// The upstream refuses: its answer as it came.
	_, resp, err = dialWS(t, "ws://"+tp.addr+"/v1/realtime", &websocket.DialOptions{})
	if err == nil || resp == nil || resp.StatusCode != 403 {
		t.Fatalf("refused upgrade: %v %v", err, resp)
	}
	if r := tp.rec.next(t); r.Status != 403 || r.Outcome != metrics.OutcomeOK {
		t.Fatalf("refused upgrade record %+v", r)
	}

	// A route without websocket: true.
	plain := startProxy(t, up, nil)
	_, resp, err = dialWS(t, "ws://"+plain.addr+"/v1/realtime", opts)
	if err == nil || resp == nil || resp.StatusCode != 400 {
		t.Fatalf("upgrade on a plain route: %v %v", err, resp)
	}
	if r := plain.rec.next(t); r.Status != 400 || r.Outcome != metrics.OutcomeBadRequest {
		t.Fatalf("record %+v", r)
	}
}

// The upstream closes the session: the client sees the close, the record
// says ok; over TLS on the client side the tunnel is the same.
func TestWebSocketUpstreamClosesOverTLS(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		c.Write(context.Background(), websocket.MessageText, []byte("hello"))
		c.Close(websocket.StatusGoingAway, "bye")
	})
	ca := tlstest.NewCA(t, "ca")
	tp := serveProxy(t, Config{Routes: []Route{{Name: "rt", Prefix: "/", Upstream: up.URL, Timeouts: DefaultTimeouts, WebSocket: true}}},
		Options{}, &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}})
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool}}}
	c, _, err := dialWS(t, "wss://"+tp.addr+"/v1/realtime", &websocket.DialOptions{HTTPClient: client})
	if err != nil {
		t.Fatal(err)
	}
	_, b, err := c.Read(context.Background())
	if err != nil || string(b) != "hello" {
		t.Fatalf("%v %q", err, b)
	}
	_, _, err = c.Read(context.Background())
	if websocket.CloseStatus(err) != websocket.StatusGoingAway {
		t.Fatalf("close: %v", err)
	}
	c.CloseNow()
	r := tp.rec.next(t)
	if r.Status != 101 || r.Outcome != metrics.OutcomeOK || r.BytesOut < 5 {
		t.Fatalf("record %+v", r)
	}
}

// A session still open when the drain runs out is cut and recorded as
// such.
func TestWebSocketCutAtShutdown(t *testing.T) {
	up := echoServer(t)
	rec := newRecorder()
	p, err := New(Config{Routes: []Route{{Name: "rt", Prefix: "/", Upstream: up, Timeouts: DefaultTimeouts, WebSocket: true}}},
		Options{Sinks: []metrics.Sink{rec}})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go p.Serve(ln)
	defer p.Close()
	c, _, err := dialWS(t, "ws://"+ln.Addr().String()+"/", &websocket.DialOptions{HTTPHeader: http.Header{"Authorization": {"Bearer k"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseNow()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := p.Shutdown(ctx); err == nil {
		t.Fatal("the drain did not wait for the open session")
	}
	if !p.Cut(5 * time.Second) {
		t.Fatal("the cut session was not recorded")
	}
	if r := rec.next(t); r.Outcome != metrics.OutcomeShutdown || r.Status != 101 {
		t.Fatalf("record %+v", r)
	}
}

// A client that closes its session while the upstream is silent ends the
// tunnel at once: both sides close and the record is written. It kept the
// tenant's slot and the upstream connection until the route's idle
// timeout, waiting for the upstream to answer a half-close.
func TestWebSocketClientCloseEndsTheTunnel(t *testing.T) {
	release := make(chan struct{})
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		<-release // silent: it neither reads nor writes
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Routes[0].WebSocket = true
		c.Routes[0].Timeouts.Idle = 30 * time.Second
	})
	t.Cleanup(func() { close(release) })
	c, _, err := dialWS(t, "ws://"+tp.addr+"/v1/realtime", nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Write(context.Background(), websocket.MessageText, []byte("hi")); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.CloseNow() // the client leaves without a close handshake
	select {
	case r := <-tp.rec.ch:
		if r.Status != 101 {
			t.Fatalf("record %+v", r)
		}
		t.Logf("recorded %v after the client left", time.Since(start).Round(time.Millisecond))
	case <-time.After(5 * time.Second):
		t.Fatal("the tunnel outlives its client (idle timeout 30 s)")
	}
}
