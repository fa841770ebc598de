package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/tlstest"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// echoStream is an upstream that streams n chat chunks naming the
// request's body (so that every stream's bytes are its own), a token
// every gap; it counts the requests in flight (their most at once) and
// those its client (tokentap) cancelled.
type echoStream struct {
	n                    int
	gap                  time.Duration
	inflight, most, seen atomic.Int32
	cancelled, finished  atomic.Int32
}

func (e *echoStream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.seen.Add(1)
	now := e.inflight.Add(1)
	defer e.inflight.Add(-1)
	defer e.finished.Add(1)
	for m := e.most.Load(); now > m && !e.most.CompareAndSwap(m, now); m = e.most.Load() {
	}
	body, _ := io.ReadAll(r.Body)
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	flush(w)
	for i := range e.n {
		select {
		case <-r.Context().Done():
			e.cancelled.Add(1)
			return
		case <-time.After(e.gap):
		}
		io.WriteString(w, chatChunk(fmt.Sprintf("%s-%d", bytes.TrimSpace(body), i)))
		flush(w)
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

// h2cTransport speaks HTTP/2 with prior knowledge over plain TCP.
func h2cTransport() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{Protocols: &p}
}

// h2cClient is an HTTP/2 client with prior knowledge over plain TCP.
func h2cClient() *http.Client { return &http.Client{Transport: h2cTransport()} }

// h2cConn is one HTTP/2 connection to addr, with prior knowledge.
func h2cConn(t *testing.T, addr string) *http.ClientConn {
	t.Helper()
	cc, err := h2cTransport().NewClientConn(context.Background(), "http", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// post sends body to url's chat path with c and returns the response's
// protocol and body.
func post(t *testing.T, c interface {
	Do(*http.Request) (*http.Response, error)
}, url, body string) (string, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		t.Error(err)
		return "", ""
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Errorf("%s: status %d, %v", resp.Proto, resp.StatusCode, err)
	}
	for _, k := range []string{"Connection", "Keep-Alive", "Transfer-Encoding"} {
		if resp.ProtoMajor == 2 && resp.Header.Get(k) != "" {
			t.Errorf("HTTP/2 response with %s: %q", k, resp.Header.Get(k))
		}
	}
	return resp.Proto, string(b)
}

// clientConnDoer runs requests on one HTTP/2 connection.
type clientConnDoer struct{ cc *http.ClientConn }

func (d clientConnDoer) Do(r *http.Request) (*http.Response, error) { return d.cc.RoundTrip(r) }

// HTTP/2 clients, h2c with prior knowledge on the plain listener and h2
// by ALPN on the TLS one, go through the same request path as HTTP/1.1
// clients on the same listeners: 50 streams multiplexed on one
// connection, each stream's bytes the backend's own, a record each with
// its client's protocol and its first token's time; curl both ways.
func TestH2ClientsOnTheSameListeners(t *testing.T) {
	up := &echoStream{n: 8, gap: 2 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	ca := tlstest.NewCA(t, "h2 CA")
	plain := startProxy(t, srv.URL, nil)
	secure := startTLSProxy(t, srv.URL, &tls.Config{Certificates: []tls.Certificate{ca.Issue(t, false)}})
	direct := func(body string) string {
		_, b := post(t, http.DefaultClient, srv.URL, body)
		return b
	}

	// 50 streams at once on one h2c connection.
	cc := h2cConn(t, plain.addr)
	const streams = 50
	got := make([]string, streams)
	var wg sync.WaitGroup
	for i := range streams {
		wg.Go(func() {
			proto, b := post(t, clientConnDoer{cc}, "http://"+plain.addr, fmt.Sprintf("s%d", i))
			if proto != "HTTP/2.0" {
				t.Errorf("stream %d over %s", i, proto)
			}
			got[i] = b
		})
	}
	wg.Wait()
	for i, b := range got {
		if want := direct(fmt.Sprintf("s%d", i)); b != want || !strings.HasSuffix(b, "data: [DONE]\n\n") {
			t.Fatalf("stream %d: %q, the backend's %q", i, b, want)
		}
	}
	if m := up.most.Load(); m < 2 {
		t.Errorf("the 50 streams reached the backend %d at a time: not multiplexed", m)
	}
	checkRecords(t, plain, streams, metrics.Record{ClientProtocol: "HTTP/2", Events: up.n})

	// h2 over TLS (ALPN), and HTTP/1.1 on both listeners.
	var onlyH2 http.Protocols
	onlyH2.SetHTTP2(true)
	h2tls := &http.Client{Transport: &http.Transport{Protocols: &onlyH2, TLSClientConfig: &tls.Config{RootCAs: ca.Pool, ServerName: "localhost"}}}
	h1tls := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", NextProtos: []string{"http/1.1"}}}}
	for _, c := range []struct {
		tp     *testProxy
		client *http.Client
		proto  string
	}{{secure, h2tls, "HTTP/2.0"}, {secure, h1tls, "HTTP/1.1"}, {plain, http.DefaultClient, "HTTP/1.1"}, {plain, h2cClient(), "HTTP/2.0"}} {
		proto, b := post(t, c.client, c.tp.url, "one")
		if proto != c.proto || b != direct("one") {
			t.Fatalf("%s on %s: %s, %q", c.proto, c.tp.url, proto, b)
		}
		want := "HTTP/2"
		if c.proto == "HTTP/1.1" {
			want = "HTTP/1.1"
		}
		checkRecords(t, c.tp, 1, metrics.Record{ClientProtocol: want, Events: up.n})
	}

	// curl, both ways.
	if _, err := exec.LookPath("curl"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("curl is missing: .ci/run installs Debian's curl package")
		}
		t.Skip("no curl here (Debian: apt-get install curl)")
	}
	caFile := ca.File(t)
	for _, c := range []struct {
		tp   *testProxy
		args []string
	}{{plain, []string{"--http2-prior-knowledge"}}, {secure, []string{"--http2", "--cacert", caFile, "--resolve", "localhost:" + port(secure.addr) + ":127.0.0.1"}}} {
		url := c.tp.url
		if c.tp == secure {
			url = "https://localhost:" + port(secure.addr)
		}
		args := append([]string{"-sS", "-w", "\n%{http_version}", "-H", "Content-Type: application/json", "--data-binary", "curl"}, c.args...)
		out, err := exec.Command("curl", append(args, url+"/v1/chat/completions")...).Output()
		if err != nil {
			t.Fatalf("curl %v: %v", c.args, err)
		}
		body, version, _ := strings.Cut(string(out), "\n2")
		if version != "" || !strings.HasSuffix(string(out), "\n2") || body+"\n" != direct("curl") && body != direct("curl") {
			t.Fatalf("curl %v: HTTP version or bytes differ: %q", c.args, out)
		}
		checkRecords(t, c.tp, 1, metrics.Record{ClientProtocol: "HTTP/2", Events: up.n})
	}
}

// port is the port of addr.
func port(addr string) string { _, p, _ := net.SplitHostPort(addr); return p }

// checkRecords reads n records of tp: each ok, with want's protocol and
// events, and a first token's time.
func checkRecords(t *testing.T, tp *testProxy, n int, want metrics.Record) {
	t.Helper()
	for range n {
		r := tp.rec.next(t)
		if r.Outcome != metrics.OutcomeOK || r.ClientProtocol != want.ClientProtocol || r.Events != want.Events || r.TTFT <= 0 || r.E2E < r.TTFT {
			t.Fatalf("record: outcome %s, protocol %q, events %d, ttft %v, e2e %v; want %q and %d events",
				r.Outcome, r.ClientProtocol, r.Events, r.TTFT, r.E2E, want.ClientProtocol, want.Events)
		}
		// The client's side: the stream's times and the path's round trip.
		if r.ClientRTT <= 0 || r.ClientTTFT < r.TTFT+r.ClientRTT || r.ClientE2E < r.E2E {
			t.Fatalf("%s record: client rtt %v, client ttft %v (ttft %v), client e2e %v (e2e %v)", r.ClientProtocol, r.ClientRTT, r.ClientTTFT, r.TTFT, r.ClientE2E, r.E2E)
		}
	}
}

// A client that resets its stream (RST_STREAM) cancels its upstream
// request, as a client that closes its HTTP/1.1 connection does; its
// connection's other streams go on.
func TestH2ResetCancelsUpstream(t *testing.T) {
	up := &echoStream{n: 400, gap: 10 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxy(t, srv.URL, nil)
	cc := h2cConn(t, tp.addr)
	ctx, cancel := context.WithCancel(context.Background())
	openH2Stream(t, ctx, cc, tp.addr, "reset")
	cancel() // the client's transport resets the stream
	waitUntil(t, func() bool { return up.cancelled.Load() == 1 })
	r := tp.rec.next(t)
	if r.Outcome != metrics.OutcomeClientCancel || r.ClientProtocol != "HTTP/2" {
		t.Fatalf("record of the reset stream: outcome %s, protocol %q", r.Outcome, r.ClientProtocol)
	}
	up.n = 3
	if _, b := post(t, clientConnDoer{cc}, "http://"+tp.addr, "after"); !strings.HasSuffix(b, "data: [DONE]\n\n") {
		t.Fatalf("the connection's next stream: %q", b)
	}
}

// A rapid-reset flood (CVE-2023-44487: streams opened and reset at once,
// as fast as a client can write them) does not take more than its share:
// no more requests reach the upstream at once than the streams a
// connection may have open, and another client is served meanwhile.
func TestH2RapidResetTakesItsShare(t *testing.T) {
	up := &echoStream{n: 50, gap: 20 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxyRecords(t, srv.URL, nil, Options{}, 20000)
	conn, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	go io.Copy(io.Discard, conn) // the server's frames, unread but taken
	fr := http2.NewFramer(conn, conn)
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", tp.addr}, {":path", "/v1/chat/completions"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	done := make(chan int)
	go func() {
		n := 0
		for id := uint32(1); id < 2*10000; id += 2 {
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true}) != nil ||
				fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
				break
			}
			n++
		}
		done <- n
	}()
	// Meanwhile another client is served.
	if _, b := post(t, h2cClient(), tp.url, "bystander"); !strings.HasSuffix(b, "data: [DONE]\n\n") {
		t.Fatalf("a client beside the flood: %q", b)
	}
	sent := <-done
	if most := up.most.Load(); most > h2MaxStreams+1 {
		t.Fatalf("%d streams opened and reset: %d requests at the upstream at once, over %d streams and the bystander", sent, most, h2MaxStreams)
	}
	t.Logf("%d streams opened and reset; %d reached the upstream, at most %d at once", sent, up.seen.Load(), up.most.Load())
}

// h2load (nghttp2's load generator) multiplexes 20 requests 10 at a time
// on one h2c connection: all succeed, each recorded as HTTP/2.
func TestH2LoadMultiplexes(t *testing.T) {
	if _, err := exec.LookPath("h2load"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("h2load is missing: .ci/run installs Debian's nghttp2-client package")
		}
		t.Skip("no h2load here (Debian: apt-get install nghttp2-client)")
	}
	up := &echoStream{n: 5, gap: 5 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxy(t, srv.URL, nil)
	body := t.TempDir() + "/body"
	if err := os.WriteFile(body, []byte("h2load"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("h2load", "-n", "20", "-c", "1", "-m", "10", "-d", body, tp.url+"/v1/chat/completions").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "20 succeeded, 0 failed") || !strings.Contains(string(out), "h2c") {
		t.Fatalf("h2load: %v\n%s", err, out)
	}
	checkRecords(t, tp, 20, metrics.Record{ClientProtocol: "HTTP/2", Events: up.n})
	if m := up.most.Load(); m < 2 {
		t.Errorf("h2load's 10 at a time reached the backend %d at a time", m)
	}
}

// An HTTP/2 client grants each stream a window and widens it as its
// application reads: a client whose application stops reading for a
// while holds tokentap's writes of that stream (no more bytes may go),
// which the record shows as the client's stall, held by the client.
func TestH2ClientWindowHoldsTheStream(t *testing.T) {
	up := &echoStream{n: 60, gap: 10 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxy(t, srv.URL, nil)
	h, err := dialH2With(tp.addr, http2.Setting{ID: http2.SettingInitialWindowSize, Val: 300})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var pause time.Duration
	got, paused := 0, false
	sid := h.send("window")
	for ended := false; !ended; {
		f, err := h.fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				err = h.fr.WriteSettingsAck()
			}
		case *http2.DataFrame:
			n := len(f.Data())
			got += n
			ended = f.StreamEnded()
			if !paused && got > 600 {
				// The application reads nothing until the backend has
				// sent its last token (about half a second on).
				paused, pause = true, -time.Duration(time.Now().UnixNano())
				waitUntil(t, func() bool { return up.finished.Load() == 1 })
				pause += time.Duration(time.Now().UnixNano())
			}
			if n > 0 && !ended {
				if err = h.fr.WriteWindowUpdate(0, uint32(n)); err == nil {
					err = h.fr.WriteWindowUpdate(sid, uint32(n))
				}
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	r := tp.rec.next(t)
	if r.Outcome != metrics.OutcomeOK || r.ClientProtocol != "HTTP/2" || r.Events != up.n {
		t.Fatalf("record: %s, %q, %d events", r.Outcome, r.ClientProtocol, r.Events)
	}
	t.Logf("paused %v: client stall %v, reading stall %v held by %q", pause, r.ClientStall, r.Reading.Stall, r.Reading.HeldBy)
	// The reader had read ahead of it (tokens came every 10 ms, it reads
	// one every 50): what it waited is the pause less that lead.
	if pause < 200*time.Millisecond || r.ClientStall < pause*3/4 || r.ClientStall > pause+time.Second || r.Reading.HeldBy != metrics.HopClient || r.Reading.Stall < pause/4 {
		t.Fatalf("a stream its client's window held %v: client stall %v, reading stall %v held by %q", pause, r.ClientStall, r.Reading.Stall, r.Reading.HeldBy)
	}
}

// A CONTINUATION flood (a header block that never ends) is cut once the
// block passes the header limit, long before memory is at stake; the
// proxy goes on serving.
func TestH2ContinuationFloodIsCut(t *testing.T) {
	up := &echoStream{n: 2}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxy(t, srv.URL, nil)
	h, err := dialH2(tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	closed := make(chan int64, 1)
	go func() { // the server's frames, until it closes the connection
		_, _ = io.Copy(io.Discard, h.c)
		closed <- 0
	}()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", "x"}, {":path", "/"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes()}); err != nil {
		t.Fatal(err)
	}
	junk := bytes.Repeat([]byte{0x40, 0x01, 'a', 0x01, 'b'}, 3000) // 15 KB of literal fields a frame
	const most = 64 << 20
	sent, cut := 0, false
	for sent < most && !cut {
		if err := h.fr.WriteContinuation(1, false, junk); err != nil {
			cut = true // the server closed the connection
			break
		}
		sent += len(junk)
		select {
		case <-closed:
			cut = true
		default:
		}
	}
	if !cut {
		t.Fatalf("%d MiB of CONTINUATION frames sent and the connection still open", sent>>20)
	}
	t.Logf("the connection was cut after %d KB of a header block", sent>>10)
	if _, b := post(t, h2cClient(), tp.url, "after"); !strings.HasSuffix(b, "data: [DONE]\n\n") {
		t.Fatalf("after the flood: %q", b)
	}
}

// A drain lets an HTTP/2 stream under way finish: Shutdown sends GOAWAY,
// the stream's bytes all arrive, its record is ok, and Shutdown returns
// once it ended.
func TestH2DrainFinishesStreams(t *testing.T) {
	up := &echoStream{n: 30, gap: 10 * time.Millisecond}
	srv := startUpstream(t, up.ServeHTTP)
	tp := startProxy(t, srv.URL, nil)
	cc := h2cConn(t, tp.addr)
	resp := openH2Stream(t, context.Background(), cc, tp.addr, "drain")
	shut := make(chan error, 1)
	go func() { shut <- tp.p.Shutdown(context.Background()) }()
	more := make([]byte, 400) // a few tokens more, after the drain began
	if _, err := io.ReadFull(resp.Body, more); err != nil {
		t.Fatal(err)
	}
	if up.finished.Load() == 0 { // the stream cannot have ended yet
		select {
		case err := <-shut:
			t.Fatalf("Shutdown returned (%v) while a stream was under way", err)
		default:
		}
	}
	rest, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("the stream under way at the drain: %v, ends %q", err, rest[max(len(rest)-20, 0):])
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if r := tp.rec.next(t); r.Outcome != metrics.OutcomeOK || r.Events != up.n || r.ClientProtocol != "HTTP/2" {
		t.Fatalf("record of the drained stream: %s, %d events", r.Outcome, r.Events)
	}
}

// openH2Stream sends a chat with body on cc, within ctx, and reads the
// first bytes of its response: the stream is under way.
func openH2Stream(t *testing.T, ctx context.Context, cc *http.ClientConn, addr, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+addr+"/v1/chat/completions", strings.NewReader(body))
	resp, err := cc.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(resp.Body, make([]byte, 16)); err != nil {
		t.Fatal(err)
	}
	return resp
}
