package proxy

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// recorder is a sink that hands finished records to next, up to 1000
// unread.
type recorder struct {
	ch chan metrics.Record
}

func newRecorder() *recorder { return &recorder{ch: make(chan metrics.Record, 1000)} }

func (r *recorder) Observe(rec *metrics.Record) {
	select {
	case r.ch <- *rec:
	default: // a test that does not read records (a soak) must not stall the proxy
	}
}

// next waits for the next finished record.
func (r *recorder) next(t *testing.T) metrics.Record {
	t.Helper()
	select {
	case rec := <-r.ch:
		return rec
	case <-time.After(time.Minute): // an event, not a time: a minute is a hang
		t.Fatal("no record within a minute")
		return metrics.Record{}
	}
}

// none checks that no further record arrives for a while.
func (r *recorder) none(t *testing.T) {
	t.Helper()
	select {
	case rec := <-r.ch:
		t.Fatalf("unexpected extra record: %+v", rec)
	case <-time.After(100 * time.Millisecond):
	}
}

// waitFor and waitUntil wait for an event (wait.For, wait.Until).
func waitFor(t testing.TB, cond func() error) { t.Helper(); wait.For(t, cond) }

func waitUntil(t testing.TB, cond func() bool) { t.Helper(); wait.Until(t, cond) }

type testProxy struct {
	p    *Proxy
	addr string
	url  string
	rec  *recorder
}

// startProxy runs a real proxy on a loopback port in front of upstream.
func startProxy(t testing.TB, upstream string, edit func(*Config)) *testProxy {
	return startProxyOpts(t, upstream, edit, Options{})
}

func startProxyOpts(t testing.TB, upstream string, edit func(*Config), opts Options) *testProxy {
	t.Helper()
	return startProxyRecords(t, upstream, edit, opts, 1000)
}

// startProxyRecords is startProxyOpts whose recorder holds up to records
// finished records (a test that reads them all after a run of many): the
// recorder is made before the proxy serves, never swapped under it.
func startProxyRecords(t testing.TB, upstream string, edit func(*Config), opts Options, records int) *testProxy {
	t.Helper()
	tm := DefaultTimeouts
	cfg := Config{Routes: []Route{{Name: "default", Prefix: "/", Upstream: upstream, Timeouts: tm}}}
	if edit != nil {
		edit(&cfg)
	}
	return serveProxyRecords(t, cfg, opts, nil, records)
}

// serveProxy runs a real proxy with cfg on a loopback port, over TLS when
// tlsCfg is not nil.
func serveProxy(t testing.TB, cfg Config, opts Options, tlsCfg *tls.Config) *testProxy {
	t.Helper()
	return serveProxyRecords(t, cfg, opts, tlsCfg, 1000)
}

func serveProxyRecords(t testing.TB, cfg Config, opts Options, tlsCfg *tls.Config, records int) *testProxy {
	t.Helper()
	rec := &recorder{ch: make(chan metrics.Record, records)}
	opts.Sinks = append(opts.Sinks, rec)
	p, err := New(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	var ln net.Listener
	scheme := "http://"
	if tlsCfg != nil {
		ln, err = p.ListenTLS("127.0.0.1:0", tlsCfg)
		scheme = "https://"
	} else {
		ln, err = p.Listen("127.0.0.1:0")
	}
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.Serve(ln) }()
	t.Cleanup(func() {
		_ = p.Shutdown(context.Background())
		p.Close()
	})
	return &testProxy{p: p, addr: ln.Addr().String(), url: scheme + ln.Addr().String(), rec: rec}
}

// upstreamConns returns the open and idle connections of the default route.
func (tp *testProxy) upstreamConns() (open, idle int) {
	return tp.p.snap.Load().routes[0].set.Members()[0].Up.Counts()
}

// startUpstream runs a scripted net/http upstream on loopback.
func startUpstream(t testing.TB, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	s := httptest.NewServer(h)
	t.Cleanup(s.CloseClientConnections)
	t.Cleanup(s.Close)
	return s
}

// deadAddr is an address where nothing listens, on 127.0.0.2: the port
// of a closed listener on 127.0.0.1 could be handed to a later listener of
// the test (the proxy itself once, which then forwarded to itself until
// its headers were too large), never on another address.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// rawRequest sends a request on a fresh raw connection and returns it with
// a reader positioned at the response.
func rawRequest(t *testing.T, addr, req string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	return c, bufio.NewReader(c)
}

func postJSON(path, body string, extra ...string) string {
	h := strings.Join(extra, "\r\n")
	if h != "" {
		h += "\r\n"
	}
	return "POST " + path + " HTTP/1.1\r\nHost: tokentap.test\r\nContent-Type: application/json\r\n" + h +
		"Content-Length: " + itoa(len(body)) + "\r\n\r\n" + body
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}

// sseHandler writes the given events, flushing each, with a pause before each.
func flush(w http.ResponseWriter) { w.(http.Flusher).Flush() }

func chatChunk(content string) string {
	return `data: {"choices":[{"index":0,"delta":{"content":"` + content + `"}}]}` + "\n\n"
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// relayPaths are the two ways a chunked stream can be relayed: on a relay
// loop (the default) and on its own goroutine (Options.GoroutineRelay).
var relayPaths = []struct {
	name      string
	goroutine bool
}{{"loop", false}, {"goroutine", true}}

// tcpPair returns a connected client and the accepted side wrapped in a
// stamped sock.Conn.
func tcpPair(t testing.TB) (client net.Conn, server *sock.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if raw, err := ln.(*net.TCPListener).SyscallConn(); err != nil || sock.EnableRxStamps(raw) != nil {
		t.Fatal("receive timestamps could not be enabled")
	}
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); sc.Close() })
	return client, sock.NewConn(sc.(*net.TCPConn), true)
}

// stampsOn holds a stamped socket open for the rest of the test and waits
// until the kernel stamps what it receives: the first socket to ask turns a
// global switch on asynchronously, and closing the last turns it off.
func stampsOn(t testing.TB) {
	t.Helper()
	client, c := tcpPair(t)
	buf := make([]byte, 8)
	waitFor(t, func() error {
		client.Write([]byte("x"))
		if _, err := c.Read(buf); err != nil {
			t.Fatal(err)
		}
		if !c.KernelStamped() {
			return errors.New("the kernel does not stamp received packets")
		}
		return nil
	})
}
