package proxy

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// The upstream dies mid-stream: every byte it sent reaches the client, then
// the client's stream breaks without the final chunk.
func TestUpstreamDiesMidStream(t *testing.T) {
	sent := chatChunk("a") + chatChunk("b") + `data: {"choices":[{"delta":{"content":"c`
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		flush(w)
		io.WriteString(w, sent)
		flush(w)
		conn, bufw, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		bufw.Flush()
		conn.Close() // no terminating chunk
	})
	tp := startProxy(t, up.URL, nil)
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != sent {
		t.Fatalf("client got %q, want every byte sent: %q", got, sent)
	}
	if err == nil || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("client saw a clean end (err=%v), want an incomplete stream", err)
	}
	rec := tp.rec.next(t)
	if rec.Outcome != metrics.OutcomeUpstreamError || rec.Events != 2 || rec.BytesOut != int64(len(sent)) {
		t.Fatalf("record: %+v", rec)
	}
}

func TestUpstreamUnreachable(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	tp := startProxy(t, "http://"+addr, nil)
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 502 || !strings.Contains(string(b), `"code":"upstream_unavailable"`) || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("%d %q", resp.StatusCode, b)
	}
	rec := tp.rec.next(t)
	if rec.Status != 502 || rec.Outcome != metrics.OutcomeUpstreamError || rec.UpstreamTTFB != metrics.Absent || rec.E2E < 0 {
		t.Fatalf("record: %+v", rec)
	}
}

func TestTimeouts(t *testing.T) {
	t.Run("first byte → 504", func(t *testing.T) {
		up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		})
		tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].Timeouts.FirstByte = 100 * time.Millisecond })
		resp, err := http.Post(tp.url+"/v1/completions", "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 504 || !strings.Contains(string(b), "upstream_timeout") {
			t.Fatalf("%d %q", resp.StatusCode, b)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeUpstreamTimeout || rec.Status != 504 {
			t.Fatalf("record: %+v", rec)
		}
	})
	t.Run("idle gap aborts the stream", func(t *testing.T) {
		up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, chatChunk("a"))
			flush(w)
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		})
		tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].Timeouts.Idle = 150 * time.Millisecond })
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != chatChunk("a") || err == nil {
			t.Fatalf("got %q err=%v", got, err)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeUpstreamTimeout || rec.Events != 1 {
			t.Fatalf("record: %+v", rec)
		}
	})
	t.Run("a long healthy stream outlives every timeout", func(t *testing.T) {
		// Each wait is a tenth of its timeout (room for a loaded machine);
		// the stream as a whole lasts three times the timeout.
		const events = 30
		up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			for k := 0; k < events; k++ {
				// 80 ms to the first byte, then 40 ms a chunk.
				time.Sleep(time.Duration(1+max(0, 1-k)) * 40 * time.Millisecond)
				io.WriteString(w, chatChunk("a"))
				flush(w)
			}
		})
		tp := startProxy(t, up.URL, func(c *Config) {
			c.Routes[0].Timeouts.Idle = 400 * time.Millisecond
			c.Routes[0].Timeouts.FirstByte = 400 * time.Millisecond
		})
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || string(got) != strings.Repeat(chatChunk("a"), events) {
			t.Fatalf("got %d bytes, err=%v", len(got), err)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK || rec.Events != events {
			t.Fatalf("record: %+v", rec)
		}
	})
}

// A pooled connection the backend closed while it was idle (uvicorn closes
// after 5 s) never fails a request: after over a second idle it is found
// closed before reuse; sooner, the request it carried is reset before any
// response byte and sent again on a new connection.
func TestPooledConnectionClosedByBackend(t *testing.T) {
	var mu sync.Mutex
	conns := map[string]bool{}
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		conns[r.RemoteAddr] = true
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	}))
	s.Config.IdleTimeout = 100 * time.Millisecond
	s.Start()
	t.Cleanup(s.Close)
	tp := startProxy(t, s.URL, nil)
	for i, wait := range []time.Duration{0, 300 * time.Millisecond, 1200 * time.Millisecond} {
		time.Sleep(wait)
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
		if err != nil {
			t.Fatalf("request %d after %v idle: %v", i, wait, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"ok"`) {
			t.Fatalf("request %d after %v idle: %d %q", i, wait, resp.StatusCode, b)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK {
			t.Fatalf("request %d after %v idle: %+v", i, wait, rec)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(conns) != 3 {
		t.Fatalf("backend saw %d connections, want 3 (each idle one closed by it)", len(conns))
	}
	if open, _ := tp.upstreamConns(); open != 1 {
		t.Fatalf("pool: %d open, want 1", open)
	}
}

// The upstream write timeout bounds writing a request the backend does not
// read; after a large request set it, a later small one on the same pooled
// connection is not cut by the old deadline.
func TestUpstreamWriteTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close() // accepted, never read
		}
	}()
	tp := startProxy(t, "http://"+ln.Addr().String(), func(c *Config) { c.Routes[0].Timeouts.Write = 200 * time.Millisecond })
	big := `{"model":"m","pad":"` + strings.Repeat("x", 16<<20) + `"}`
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(big))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// No bound on the time taken: 16 MiB through -race on a busy machine
	// takes seconds. The record says which timeout ended it (the others
	// are minutes away).
	if rec := tp.rec.next(t); resp.StatusCode != http.StatusGatewayTimeout || rec.Outcome != metrics.OutcomeUpstreamTimeout ||
		rec.Error != "cannot send the request upstream: timed out" {
		t.Fatalf("status %d, record: %+v", resp.StatusCode, rec)
	}

	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"choices":[]}`)
	})
	tp = startProxy(t, up.URL, func(c *Config) { c.Routes[0].Timeouts.Write = 100 * time.Millisecond })
	for i, body := range []string{`{"model":"m","pad":"` + strings.Repeat("x", 64<<10) + `"}`, `{"model":"m"}`} {
		if i > 0 {
			time.Sleep(300 * time.Millisecond) // the first request's deadline has passed
		}
		resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		tp.rec.next(t)
	}
	if open, _ := tp.upstreamConns(); open != 1 {
		t.Fatalf("%d upstream connections, want 1 (the second request reused the first's)", open)
	}
}

// Idle pooled connections are closed once they outlive IdleConn, without a
// request coming to find them, and the backend sees them close.
func TestIdleConnectionsReaped(t *testing.T) {
	closed := make(chan struct{}, 10)
	s := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"choices":[]}`)
	}))
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateClosed {
			closed <- struct{}{}
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	tp := startProxy(t, s.URL, func(c *Config) { c.Routes[0].Timeouts.IdleConn = 200 * time.Millisecond })
	var wg sync.WaitGroup
	for range 3 { // three at once: three connections
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m"}`))
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	wg.Wait()
	for range 3 {
		tp.rec.next(t)
	}
	if open, idle := tp.upstreamConns(); open == 0 || open != idle {
		t.Fatalf("after the requests: open=%d idle=%d, want all open ones idle", open, idle)
	}
	waitFor(t, func() error {
		if open, idle := tp.upstreamConns(); open != 0 || idle != 0 {
			return fmt.Errorf("idle connections not reaped: open=%d idle=%d", open, idle)
		}
		return nil
	})
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("the backend never saw a pooled connection close")
	}
}

// max_conns holds across reloads: a configuration's upstream takes over
// the connections (and their count) of the one it replaces when it reaches
// the backend the same way. With a cap of 2 held by two streams, a reload
// that changed the timeouts did not let a third connection open (it gave
// 12 connections for a cap of 6 before); a reload storm under traffic
// leaves no connection but those the pool keeps idle.
func TestMaxConnsHoldAcrossReloads(t *testing.T) {
	var open, peak atomic.Int64
	release := make(chan struct{})
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: {}\n\n")
			flush(w)
			<-release
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}))
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			if n := open.Add(1); n > peak.Load() {
				peak.Store(n)
			}
		case http.StateClosed, http.StateHijacked:
			open.Add(-1)
		}
	}
	up.Start()
	t.Cleanup(up.Close)
	unblock := sync.OnceFunc(func() { close(release) })
	cfgOf := func(firstByte time.Duration) Config {
		tm := DefaultTimeouts
		tm.MaxConns, tm.MaxIdleConns, tm.FirstByte = 2, 2, firstByte
		return Config{Routes: []Route{{Name: "default", Prefix: "/", Upstream: up.URL, Timeouts: tm}}}
	}
	tp := serveProxy(t, cfgOf(30*time.Second), Options{}, nil)
	t.Cleanup(unblock) // before the proxy and the backend stop, on a failure too
	var streams []*http.Response
	for range 2 {
		resp, err := http.Post(tp.url+"/hold", "application/json", strings.NewReader(`{}`))
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("a held stream: %v %v", resp, err)
		}
		streams = append(streams, resp)
	}
	if err := tp.p.Apply(cfgOf(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(tp.url+"/other", "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == 200 || peak.Load() > 2 {
		t.Fatalf("a third request after the reload: %d, %d connections at the backend at most (max_conns 2)", resp.StatusCode, peak.Load())
	}
	unblock()
	for _, s := range streams {
		io.Copy(io.Discard, s.Body)
		s.Body.Close()
	}

	// A reload storm under traffic.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				if resp, err := http.Post(tp.url+"/x", "application/json", strings.NewReader(`{}`)); err == nil {
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
		})
	}
	for i := range 50 {
		if err := tp.p.Apply(cfgOf(time.Duration(10+i) * time.Second)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	http.DefaultClient.CloseIdleConnections()
	if p := peak.Load(); p > 2 {
		t.Fatalf("%d connections open at the backend at once under reloads, max_conns 2", p)
	}
	waitFor(t, func() error { // the backend's count of closes comes after the pool's
		if pooled, idle := tp.upstreamConns(); open.Load() > 2 || int64(pooled) != open.Load() || idle != pooled {
			return fmt.Errorf("after 50 reloads under traffic: %d connections open at the backend, the pool counts %d open and %d idle", open.Load(), pooled, idle)
		}
		return nil
	})
}
