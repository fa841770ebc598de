package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

// readEvent reads one SSE event ("...\n\n") from a response body.
func readEvent(br *bufio.Reader) (string, error) {
	var b strings.Builder
	for {
		line, err := br.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			return b.String(), err
		}
		if line == "\n" {
			return b.String(), nil
		}
	}
}

// The upstream sends token k+1 only after the client has received token k:
// any buffering anywhere in the relay would deadlock this test.
func TestPerEventDeliveryLockstep(t *testing.T) {
	const n = 20
	received := make(chan int)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		flush(w)
		for k := 0; k < n; k++ {
			io.WriteString(w, chatChunk(itoa(k)))
			flush(w)
			select {
			case got := <-received:
				if got != k {
					t.Errorf("client got %d, expected %d", got, k)
					return
				}
			case <-time.After(30 * time.Second): // lockstep: a buffered token never arrives
				t.Errorf("client did not receive token %d: the relay buffers", k)
				return
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for k := 0; k < n; k++ {
		ev, err := readEvent(br)
		if err != nil {
			t.Fatalf("event %d: %v", k, err)
		}
		if ev != chatChunk(itoa(k)) {
			t.Fatalf("event %d = %q", k, ev)
		}
		received <- k
	}
	rest, _ := io.ReadAll(br)
	if string(rest) != "data: [DONE]\n\n" {
		t.Fatalf("tail %q", rest)
	}
	rec := tp.rec.next(t)
	if rec.Events != n || rec.OutputTokens != n || rec.TokensSource != "counted" || rec.ITLCount != n-1 {
		t.Fatalf("record: %+v", rec)
	}
}

// Timings against a scripted schedule: headers at once, a role-only chunk
// and a keep-alive at once, the first token at 50 ms, then 9 tokens 20 ms
// apart, then the usage chunk and [DONE].
func TestTimingsAgainstSchedule(t *testing.T) {
	const first, gap, tokens = 50 * time.Millisecond, 20 * time.Millisecond, 10
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, `data: {"choices":[{"delta":{"role":"assistant","content":""}}]}`+"\n\n: keep-alive\n\n")
		flush(w)
		next := time.Now().Add(first)
		for k := 0; k < tokens; k++ {
			time.Sleep(time.Until(next))
			io.WriteString(w, chatChunk("t"))
			flush(w)
			next = time.Now().Add(gap)
		}
		io.WriteString(w, `data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":10}}`+"\n\ndata: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	start := time.Now()
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	clientE2E := time.Since(start)
	rec := tp.rec.next(t)
	// Lower bounds are exact (the schedule cannot run faster); above them
	// only what the client's own clock bounds (a loaded machine can delay
	// anything). The rules themselves are TestMeterRules, on exact times.
	if rec.TTFT < first || rec.TTFT > clientE2E {
		t.Errorf("ttft_ms = %.3f, want ≈ %v (the role-only chunk must not count)", ms(rec.TTFT), first)
	}
	wantE2E := first + (tokens-1)*gap
	if rec.E2E < wantE2E || rec.E2E > clientE2E {
		t.Errorf("e2e_ms = %.3f, want ≥ %v and ≤ client's %v", ms(rec.E2E), wantE2E, clientE2E)
	}
	// The gaps add up to the time between the first and last token, which
	// the schedule makes at least (tokens-1)·gap.
	if rec.ITLCount != tokens-1 || rec.ITLMean*(tokens-1) < (tokens-1)*gap-time.Millisecond ||
		rec.ITLMax < rec.ITLP99 || rec.ITLP99 < rec.ITLP50 {
		t.Errorf("itl: count=%d p50=%v p99=%v max=%v", rec.ITLCount, rec.ITLP50, rec.ITLP99, rec.ITLMax)
	}
	if rec.OutputTokens != 10 || rec.InputTokens != 7 || rec.TokensSource != "usage" || rec.Events != tokens {
		t.Errorf("tokens: %+v", rec)
	}
	wantTPOT := (rec.E2E - rec.TTFT) / (tokens - 1)
	if rec.TPOT != wantTPOT {
		t.Errorf("tpot = %v, want (e2e-ttft)/(n-1) = %v", rec.TPOT, wantTPOT)
	}
	if rec.Overhead < 0 || rec.Overhead > rec.TTFT || rec.UpstreamTTFB < 0 || rec.UpstreamTTFB > rec.TTFT {
		t.Errorf("overhead=%v ttfb=%v", rec.Overhead, rec.UpstreamTTFB)
	}
	if rec.ClientRTT < 0 {
		t.Errorf("client rtt absent")
	}
}

// waitClosed waits until the upstream handler saw its client go.
// waitClosed waits for the upstream to see its request cancelled. The
// upstreams of these tests write nothing for a minute or more, so nothing
// but tokentap's cancel can end their request within the wait: no bound
// on how soon (a loaded machine delays anything), only that it comes.
func waitClosed(t *testing.T, ch chan time.Time, since time.Time, what string) {
	t.Helper()
	select {
	case at := <-ch:
		t.Logf("%s: the upstream saw the cancel %v after the close", what, at.Sub(since))
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: upstream request not cancelled", what)
	}
}

func TestClientCancelMidStream(t *testing.T) {
	cancelled := make(chan time.Time, 1)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // net/http notices a closed client only once the body is read
		w.Header().Set("Content-Type", "text/event-stream")
		for k := 0; ; k++ {
			io.WriteString(w, chatChunk("x"))
			flush(w)
			select {
			case <-r.Context().Done():
				cancelled <- time.Now()
				return
			case <-time.After(time.Minute): // long gaps: no write reveals the close in time
			}
		}
	})
	tp := startProxy(t, up.URL, nil)
	c, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
	if _, err := http.ReadResponse(br, nil); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 100)
	br.Read(buf)
	c.Close()
	closedAt := time.Now()
	waitClosed(t, cancelled, closedAt, "mid-stream")
	rec := tp.rec.next(t)
	if rec.Outcome != metrics.OutcomeClientCancel || rec.Events < 1 || rec.TTFT < 0 {
		t.Fatalf("record: %+v", rec)
	}
	if open, idle := tp.upstreamConns(); open != 0 || idle != 0 {
		t.Fatalf("cancelled upstream connection kept: open=%d idle=%d", open, idle)
	}
	tp.rec.none(t)
}

// A client that sent its next request during a stream and then closed its
// side has not left that stream: the bytes waiting in the socket tell it
// apart, on the relay loop (which watches the close there) as on the peer
// watch, and the stream goes through whole.
func TestNextRequestThenHalfClose(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for k := range 4 {
			io.WriteString(w, chatChunk(itoa(k+1)))
			flush(w)
			time.Sleep(40 * time.Millisecond)
		}
	})
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			tp := startProxyOpts(t, up.URL, nil, Options{GoroutineRelay: path.goroutine})
			req := func(id string) string {
				return postJSON("/v1/chat/completions", `{"stream":true}`, "X-Request-Id: "+id)
			}
			c, br := rawRequest(t, tp.addr, req("first"))
			want := chatChunk("1") + chatChunk("2") + chatChunk("3") + chatChunk("4")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			// The first stream is under way: the next request, then the
			// client's side closed.
			if _, err := io.WriteString(c, req("second")); err != nil {
				t.Fatal(err)
			}
			if err := c.(*net.TCPConn).CloseWrite(); err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(resp.Body)
			if err != nil || string(body) != want {
				t.Fatalf("the first stream: %q, %v", body, err)
			}
			io.Copy(io.Discard, br)
			// The next request comes from a client whose side is closed,
			// which counts as gone (see downstream.Watch): it is cancelled. (Its
			// record can come first: the first one waits for the ACK.)
			got := map[string]metrics.Record{}
			for range 2 {
				r := tp.rec.next(t)
				got[r.RequestID] = r
			}
			if r := got["first"]; r.Outcome != metrics.OutcomeOK || r.Events != 4 {
				t.Fatalf("the first stream's record: %s, %d events", r.Outcome, r.Events)
			}
			if r := got["second"]; r.Outcome != metrics.OutcomeClientCancel {
				t.Fatalf("the second stream's record: %q", r.Outcome)
			}
		})
	}
}

// A client that leaves during a long prefill cancels the request at the
// backend, seen by the peer watch: a relay loop's (the default) and the
// goroutine's of a proxy without loops.
func TestClientCancelDuringPrefill(t *testing.T) {
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			cancelled := make(chan time.Time, 1)
			started := make(chan struct{})
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				io.ReadAll(r.Body) // net/http notices a closed client only once the body is read
				close(started)
				select { // a long prefill: not one byte before a minute
				case <-r.Context().Done():
					cancelled <- time.Now()
				case <-time.After(time.Minute):
				}
			})
			tp := startProxyOpts(t, up.URL, nil, Options{GoroutineRelay: path.goroutine})
			c, _ := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
			<-started
			c.Close()
			closedAt := time.Now()
			waitClosed(t, cancelled, closedAt, "prefill")
			rec := tp.rec.next(t)
			if rec.Outcome != metrics.OutcomeClientCancel || rec.TTFT != metrics.Absent {
				t.Fatalf("record: %+v", rec)
			}
			if open, idle := tp.upstreamConns(); open != 0 || idle != 0 {
				t.Fatalf("cancelled upstream connection kept: open=%d idle=%d", open, idle)
			}
		})
	}
}

// A keep-alive client connection survives the peer watch: several streamed
// requests in a row on one connection, and one upstream connection reused.
func TestKeepAliveAfterStreamAndPoolReuse(t *testing.T) {
	conns := map[string]bool{}
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		conns[r.RemoteAddr] = true
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a"))
		flush(w)
		time.Sleep(5 * time.Millisecond)
		io.WriteString(w, chatChunk("b")+"data: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	c, br := rawRequest(t, tp.addr, "")
	for i := 0; i < 3; i++ {
		io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil || string(b) != chatChunk("a")+chatChunk("b")+"data: [DONE]\n\n" {
			t.Fatalf("request %d: %q %v", i, b, err)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK || rec.Events != 2 {
			t.Fatalf("record %d: %+v", i, rec)
		}
	}
	if len(conns) != 1 {
		t.Fatalf("upstream saw %d connections, want 1 (pooled)", len(conns))
	}
	if open, idle := tp.upstreamConns(); open != 1 || idle != 1 {
		t.Fatalf("pool: open=%d idle=%d", open, idle)
	}
}

// HTTP/1.0 clients cannot read chunked encoding: they get the stream
// unframed, ended by the close; a broken upstream resets the connection.
func TestHTTP10ClientGetsUnframedStream(t *testing.T) {
	body := chatChunk("a") + chatChunk("b")
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a"))
		flush(w)
		time.Sleep(10 * time.Millisecond)
		io.WriteString(w, chatChunk("b"))
		if r.URL.Path == "/broken" {
			flush(w)
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		}
	})
	tp := startProxy(t, up.URL, nil)
	c, br := rawRequest(t, tp.addr, "POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	if err != nil || string(got) != body || len(resp.TransferEncoding) != 0 || !resp.Close {
		t.Fatalf("body %q err %v te %v close %v", got, err, resp.TransferEncoding, resp.Close)
	}
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK || rec.Events != 2 || rec.TTFT < 0 {
		t.Fatalf("record: %+v", rec)
	}

	c, br = rawRequest(t, tp.addr, "POST /broken HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
	c.SetReadDeadline(time.Now().Add(3 * time.Second))
	if resp, err = http.ReadResponse(br, nil); err != nil {
		t.Fatal(err)
	}
	got, err = io.ReadAll(resp.Body)
	if string(got) != body || err == nil {
		t.Fatalf("broken upstream: body %q err %v, want every byte then a reset; %+v", got, err, tp.rec.next(t))
	}
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeUpstreamError {
		t.Fatalf("record: %+v", rec)
	}
}

// The server's request read timeout must not end the peer watch: a client
// leaving long after it (here 300 ms after a 100 ms read timeout) still
// cancels the upstream at once.
func TestCancelDetectedAfterRequestReadTimeout(t *testing.T) {
	cancelled := make(chan time.Time, 1)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		select {
		case <-r.Context().Done():
			cancelled <- time.Now()
		case <-time.After(time.Minute):
		}
	})
	tp := startProxyOpts(t, up.URL, nil, Options{RequestReadTimeout: 100 * time.Millisecond})
	c, _ := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
	time.Sleep(300 * time.Millisecond)
	c.Close()
	waitClosed(t, cancelled, time.Now(), "after read timeout")
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("record: %+v", rec)
	}
}

// Headers the upstream sends before its first token reach the client at
// once, not with the first token.
func TestHeadersRelayedBeforeFirstToken(t *testing.T) {
	release := make(chan struct{})
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		flush(w)
		<-release
		io.WriteString(w, chatChunk("a"))
	})
	tp := startProxy(t, up.URL, nil)
	_, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
	got := make(chan error, 1)
	go func() {
		_, err := http.ReadResponse(br, nil)
		got <- err
	}()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second): // the first token comes only after this
		t.Fatal("headers held back until the first token")
	}
	close(release)
}

// TestSlowUploadIsNotOverhead: a client that sends its headers, then its
// body 150 ms later, waited for itself: TTFT counts it (the client lived
// it), request_upload_ms says it, overhead does not.
func TestSlowUploadIsNotOverhead(t *testing.T) {
	up := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	tp := startProxy(t, up, nil)
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"model":"m","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`
	io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "+itoa(len(body))+"\r\n\r\n")
	time.Sleep(150 * time.Millisecond)
	io.WriteString(c, body)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	r := tp.rec.next(t)
	// Overhead that counted the upload would be at least as long as it.
	if r.Upload < 150*time.Millisecond || r.TTFT < 150*time.Millisecond || r.Overhead < 0 || r.Overhead >= r.Upload {
		t.Errorf("upload %v, ttft %v, overhead %v", r.Upload, r.TTFT, r.Overhead)
	}
}
