package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/wait"

	vm "github.com/VictoriaMetrics/metrics"
)

// TestHelperLowFDProxy is not a test: run by TestFaultAcceptRecoversFromEMFILE
// in a child process, it serves a proxy under a descriptor limit of 64,
// prints the proxy's address, and on EOF of stdin prints the accept errors.
func TestHelperLowFDProxy(t *testing.T) {
	if os.Getenv("TOKENTAP_LOWFD_CHILD") != "1" {
		t.Skip("helper process")
	}
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tp := startProxy(t, up.URL, nil)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 64, Max: 64}); err != nil {
		t.Fatal(err)
	}
	fmt.Println("addr", tp.addr)
	io.Copy(io.Discard, os.Stdin)
	var b strings.Builder
	vm.WritePrometheus(&b, false)
	for _, line := range strings.Split(b.String(), "\n") {
		if strings.HasPrefix(line, "tokentap_accept_errors_total") {
			fmt.Println(line)
		}
	}
}

// One burst of connections beyond the descriptor limit must not stop the
// proxy: accept errors back off and recover, and once the burst is gone
// requests are served again.
func TestFaultAcceptRecoversFromEMFILE(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperLowFDProxy$", "-test.v")
	cmd.Env = append(os.Environ(), "TOKENTAP_LOWFD_CHILD=1")
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	out := bufio.NewScanner(stdout)
	var addr string
	for out.Scan() {
		if a, ok := strings.CutPrefix(out.Text(), "addr "); ok {
			addr = a
			break
		}
	}
	if addr == "" {
		t.Fatal("child printed no address")
	}
	// 100 idle connections: the child runs out of descriptors.
	var conns []net.Conn
	for i := 0; i < 100; i++ {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	time.Sleep(300 * time.Millisecond) // the child meets EMFILE and backs off
	for _, c := range conns {
		c.Close()
	}
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	waitFor(t, func() error { // the proxy recovers
		resp, err := client.Get("http://" + addr + "/x")
		if err != nil {
			return err
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(b) != "ok" {
			return fmt.Errorf("%d %q", resp.StatusCode, b)
		}
		return nil
	})
	stdin.Close()
	var errs string
	for out.Scan() {
		if strings.HasPrefix(out.Text(), "tokentap_accept_errors_total") {
			errs = out.Text()
		}
	}
	if errs == "" || strings.HasSuffix(errs, " 0") {
		t.Fatalf("no accept error was seen (%q): the test did not reach the descriptor limit", errs)
	}
}

// Connections beyond the caps are answered 503 at once and closed; the
// ones within are served, and a freed place can be taken again.
func TestFaultConnectionCaps(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	for _, tc := range []struct {
		name         string
		total, perIP int
	}{{"total", 3, 0}, {"per_ip", 0, 3}} {
		t.Run(tc.name, func(t *testing.T) {
			tp := startProxyOpts(t, up.URL, nil, Options{MaxConns: tc.total, MaxConnsPerIP: tc.perIP})
			var held []net.Conn
			for i := 0; i < 3; i++ {
				c, err := net.Dial("tcp", tp.addr)
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				held = append(held, c)
			}
			waitUntil(t, func() bool { return tp.p.ClientConns() == 3 })
			_, br := rawRequest(t, tp.addr, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != 503 || !strings.Contains(string(b), "too_many_connections") {
				t.Fatalf("beyond the cap: %d %q", resp.StatusCode, b)
			}
			held[0].Close()
			waitUntil(t, func() bool { return tp.p.ClientConns() == 2 })
			_, br = rawRequest(t, tp.addr, "GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
			if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != 200 {
				t.Fatalf("within the cap: %v %v", resp, err)
			}
		})
	}
}

// Slowloris: connections that send their headers a byte at a time are
// closed once the request read timeout runs out, hold little memory while
// they last, and leave the proxy serving.
func TestFaultSlowloris(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tp := startProxyOpts(t, up.URL, nil, Options{RequestReadTimeout: 600 * time.Millisecond})
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	const conns = 200
	var wg sync.WaitGroup
	closedBy := make(chan time.Duration, conns)
	start := time.Now()
	for i := 0; i < conns; i++ {
		c, err := net.Dial("tcp", tp.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			// About 25 s to send whole, against a 600 ms read timeout.
			req := "GET /x HTTP/1.1\r\nHost: h\r\nX-Slow: " + strings.Repeat("a", 470)
			for j := 0; j < len(req); j++ {
				if _, err := c.Write([]byte{req[j]}); err != nil {
					closedBy <- time.Since(start)
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
			closedBy <- -1
		}()
	}
	waitUntil(t, func() bool { return tp.p.ClientConns() >= conns/2 })
	var during runtime.MemStats
	runtime.ReadMemStats(&during)
	if grown := int64(during.HeapAlloc) - int64(before.HeapAlloc); grown > 32<<20 {
		t.Errorf("%d slow connections hold %d MiB", conns, grown>>20)
	}
	// Served meanwhile.
	if status, _ := getBody(t, tp.url, "GET", "/served"); status != 200 {
		t.Fatalf("a normal request during the attack: %d", status)
	}
	wg.Wait()
	close(closedBy)
	for d := range closedBy {
		if d < 0 || d > 10*time.Second {
			t.Fatalf("a slow connection lasted %v against a 600 ms read timeout (negative: its whole request, never closed)", d)
		}
	}
	waitUntil(t, func() bool { return tp.p.ClientConns() == 0 })
}

// A client that never reads a long stream: the proxy does not buffer it
// (memory stays small), cuts it when a write stalls past the client write
// timeout, cancels the upstream, and records it.
func TestFaultNeverReadingClient(t *testing.T) {
	upstreamDone := make(chan error, 1)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		ev := chatChunk(strings.Repeat("x", 4000))
		for i := 0; i < 20000; i++ { // 80 MB, far more than any socket buffer
			if _, err := io.WriteString(w, ev); err != nil {
				upstreamDone <- err
				return
			}
			flush(w)
		}
		upstreamDone <- nil
	})
	tp := startProxyOpts(t, up.URL, nil, Options{ClientWriteTimeout: 500 * time.Millisecond})
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	c, _ := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
	_ = c // never read
	rec := tp.rec.next(t)
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	if rec.Outcome != "client_cancel" || rec.BytesOut >= 80<<20 {
		t.Fatalf("record: outcome %s bytes_out %d", rec.Outcome, rec.BytesOut)
	}
	if grown := int64(after.HeapAlloc) - int64(before.HeapAlloc); grown > 16<<20 {
		t.Errorf("a stalled stream grew the heap by %d MiB", grown>>20)
	}
	select {
	case err := <-upstreamDone:
		if err == nil {
			t.Fatal("the upstream wrote its whole stream: nothing stopped it")
		}
	case <-time.After(30 * time.Second): // it writes 80 MB unless cancelled
		t.Fatal("the upstream was not cancelled")
	}
}

// TestFaultBufferedBodiesBounded: clients part-way through large bodies
// cannot make tokentap hold more body bytes than max_buffered_bodies in
// all: a request whose body would pass it gets 503 at once (with
// Retry-After), the others go on, and once they end the budget is free.
// One client after the other, each sending 600 KiB of a 1 MiB body and
// stalling: each held one grows its buffer to 1 MiB, so two fit in 2 MiB.
func TestFaultBufferedBodiesBounded(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	})
	const budget, size, sent = 2 << 20, 1 << 20, 600 << 10
	tp := startProxyOpts(t, up.URL, nil, Options{MaxRequestBodySize: size, MaxBufferedBodies: budget, RequestReadTimeout: time.Minute})
	var held, refused int
	var conns []net.Conn
	for i := range 6 {
		c, br := rawRequest(t, tp.addr, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: "+itoa(size)+"\r\n\r\n")
		conns = append(conns, c)
		answered := make(chan int, 1)
		go func() {
			io.WriteString(c, strings.Repeat("x", sent)) // then stalls
			c.SetReadDeadline(time.Now().Add(time.Minute))
			if resp, err := http.ReadResponse(br, nil); err == nil && resp.Header.Get("Retry-After") != "" {
				answered <- resp.StatusCode
			}
			close(answered)
		}()
		waitUntil(t, func() bool { return tp.p.bodies.Load() == int64(held+1)*size || len(answered) > 0 })
		if b := tp.p.bodies.Load(); b > budget {
			t.Fatalf("client %d: %d body bytes held, budget %d", i, b, budget)
		}
		select {
		case status := <-answered:
			if status != 503 {
				t.Fatalf("client %d: %d", i, status)
			}
			refused++
		default:
			held++
		}
	}
	if held != 2 || refused != 4 {
		t.Fatalf("%d held, %d refused; want 2 and 4", held, refused)
	}
	for _, c := range conns {
		c.Close()
	}
	waitUntil(t, func() bool { return tp.p.bodies.Load() == 0 })
	if status, _ := getBody(t, tp.url, "POST", "/x"); status != 200 {
		t.Fatalf("after the slow clients left: %d", status)
	}
}

// TestFaultStreamLetsItsBodyGo: a stream's request body leaves the budget
// of all requests' bodies (and the exchange) once its response is being
// relayed, since no attempt sends it again: while a stream with a 600 KiB
// prompt runs, a second request as large fits in a 1 MiB budget, where it
// was refused with 503 while the stream held its prompt to its end. The
// backend still got the whole prompt. Both relay paths.
func TestFaultStreamLetsItsBodyGo(t *testing.T) {
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			release := make(chan struct{})
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				n, _ := io.Copy(io.Discard, r.Body)
				if r.URL.Path != "/v1/chat/completions" {
					io.WriteString(w, "ok "+itoa(int(n)))
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, chatChunk("got "+itoa(int(n))))
				flush(w)
				select {
				case <-release:
				case <-r.Context().Done():
					return
				}
				io.WriteString(w, chatChunk("end")+"data: [DONE]\n\n")
			})
			const budget = 1 << 20
			tp := startProxyOpts(t, up.URL, nil, Options{GoroutineRelay: path.goroutine, MaxRequestBodySize: budget,
				MaxBufferedBodies: budget, RequestReadTimeout: time.Minute})
			prompt := `{"model":"m","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 600<<10) + `"}]}`

			c, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", prompt))
			c.SetReadDeadline(time.Now().Add(time.Minute))
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("stream: %v %v", resp, err)
			}
			first := make([]byte, 0, 256)
			for !strings.Contains(string(first), "\n\n") {
				var b [64]byte
				n, err := resp.Body.Read(b[:])
				if err != nil {
					t.Fatalf("first event: %v (read %q)", err, first)
				}
				first = append(first, b[:n]...)
			}
			if !strings.Contains(string(first), "got "+itoa(len(prompt))) {
				t.Fatalf("the backend did not get the whole prompt: %q", first)
			}
			// The body went before the response's first bytes did.
			if held := tp.p.bodies.Load(); held > keptBodyBuffer {
				t.Fatalf("a running stream holds %d body bytes", held)
			}

			big := strings.Repeat("y", 600<<10)
			c2, br2 := rawRequest(t, tp.addr, "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: "+itoa(len(big))+"\r\n\r\n"+big)
			c2.SetReadDeadline(time.Now().Add(time.Minute))
			resp2, err := http.ReadResponse(br2, nil)
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp2.Body)
			if resp2.StatusCode != 200 || string(got) != "ok "+itoa(len(big)) {
				t.Fatalf("a request beside the stream: %d %q", resp2.StatusCode, got)
			}

			close(release)
			rest, err := io.ReadAll(resp.Body)
			if err != nil || !strings.Contains(string(rest), "data: [DONE]") {
				t.Fatalf("the stream's end: %q %v", rest, err)
			}
			for range 2 {
				if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK {
					t.Errorf("record %s: outcome %s", rec.Path, rec.Outcome)
				}
			}
			waitUntil(t, func() bool { return tp.p.bodies.Load() == 0 })
		})
	}
}

// TestFaultUnreadResponseIsNotGood: a client that never reads a response
// that fits in the sockets' buffers: tokentap's writes all succeed, but
// the client did not acknowledge the end, so its record says so (unacked,
// no client E2E) and it is not good against the client-side SLO; the
// tokens the backend produced are still charged.
func TestFaultUnreadResponseIsNotGood(t *testing.T) {
	wait.Long(t, "a client that never reads")
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		// 75 chunks of 200 bytes: about 18 KB, within what the client's
		// kernel takes unread and the 4 KiB a stream's socket holds unsent
		// (downstream.MaxUnsent).
		for range 75 {
			io.WriteString(w, chatChunk(strings.Repeat("x", 200)))
		}
		io.WriteString(w, `data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":75}}`+"\n\ndata: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.SLO = metrics.SLO{E2E: time.Minute, Target: 0.99} })
	// The receive buffer shrinks once the connection is open (its window
	// was offered at the handshake, larger) and before the request goes:
	// set after the request, the whole response came in first now and
	// then (2 runs in 60 under the race detector), and was acknowledged.
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.(*net.TCPConn).SetReadBuffer(4 << 10); err != nil { // and never reads
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)); err != nil {
		t.Fatal(err)
	}
	rec := tp.rec.next(t)
	if rec.Outcome != metrics.OutcomeOK {
		t.Skipf("the response did not fit in the sockets' buffers here (outcome %s): nothing to judge", rec.Outcome)
	}
	if !rec.Unacked || rec.BytesAcked >= rec.BytesWire || rec.ClientE2E != metrics.Absent {
		t.Errorf("unacked %v, %d of %d bytes acknowledged, client e2e %v", rec.Unacked, rec.BytesAcked, rec.BytesWire, rec.ClientE2E)
	}
	if !rec.SLOJudged || rec.Good() || rec.SLOMisses != metrics.SLOUnacked {
		t.Errorf("judged %v good %v missed %s: a response the client did not receive is not good", rec.SLOJudged, rec.Good(), rec.SLOMisses)
	}
	if rec.OutputTokens != 75 {
		t.Errorf("%d output tokens charged, the backend made 75", rec.OutputTokens)
	}
	if n := promValue(t, `tokentap_slo_missed_total{route="default",model="other",slo="unacked"}`); n < 1 {
		t.Errorf("the unacked miss is not counted: %v", n)
	}
}
