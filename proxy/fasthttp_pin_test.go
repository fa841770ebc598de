package proxy

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/valyala/fasthttp"
)

// One writer per response: the server writes all of a response, or
// tokentap does, on a connection the server handed over. These tests pin
// what tokentap relies on in fasthttp, byte for byte, on tokentap's own
// server settings (Proxy.server) and listener: an upgrade that frames
// differently fails here instead of corrupting streams.

// pinWrites is a body stream that the server reads with WriteTo: each
// Write becomes one chunk (bodyRelay.WriteTo relies on it).
type pinWrites []string

func (w pinWrites) Read([]byte) (int, error) { return 0, io.EOF }

func (w pinWrites) SupportsBodyWriteTo() bool { return true }

func (w pinWrites) WriteTo(dst io.Writer) (int64, error) {
	var n int64
	for _, s := range w {
		k, err := io.WriteString(dst, s)
		if n += int64(k); err != nil {
			return n, err
		}
	}
	return n, nil
}

// pinServer serves handler with tokentap's server settings on tokentap's
// listener, its state hook replaced by state when given, and returns its
// address.
func pinServer(t *testing.T, handler fasthttp.RequestHandler, state func(net.Conn, fasthttp.ConnState)) (*fasthttp.Server, string) {
	t.Helper()
	p := newProxyForBench(t)
	ln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := p.server()
	srv.Handler = handler
	if state != nil {
		srv.ConnState = state
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Shutdown() })
	return srv, ln.Addr().String()
}

// readExactly reads n bytes from br, failing on a short read.
func readExactly(t *testing.T, br *bufio.Reader, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(br, b); err != nil {
		t.Fatalf("read %q, then %v", b, err)
	}
	return string(b)
}

const pinStreamHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Request-Id: r1\r\nTransfer-Encoding: chunked\r\n\r\n"

// setPinHead sets the header pinStreamHead renders for a body of unknown
// length.
func setPinHead(h *fasthttp.ResponseHeader) {
	h.SetContentType("text/event-stream")
	h.Set("X-Request-Id", "r1")
}

// What the server frames itself: a header flushed before the body; a
// body of unknown length read by WriteTo, each Write one chunk, ended by a
// bare last chunk after WriteTo returns; a known length as it is. And
// the header tokentap renders for a response it writes itself
// (servePass) is the header the server writes for the same response.
func TestFasthttpFramingPinned(t *testing.T) {
	var rendered []byte
	_, addr := pinServer(t, func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/stream":
			setPinHead(&ctx.Response.Header)
			var h fasthttp.ResponseHeader
			ctx.Response.Header.CopyTo(&h)
			h.SetContentLength(-1)
			rendered = h.AppendBytes(nil)
			ctx.Response.ImmediateHeaderFlush = true
			ctx.Response.SetBodyStream(pinWrites{"abc", "0123456789abcdefg"}, -1)
		case "/fixed":
			ctx.Response.SetBodyStream(strings.NewReader("hello"), 5)
		}
	}, nil)
	c, br := rawRequest(t, addr, "GET /stream HTTP/1.1\r\nHost: h\r\n\r\n")
	c.SetDeadline(time.Now().Add(10 * time.Second))
	want := pinStreamHead + "3\r\nabc\r\n11\r\n0123456789abcdefg\r\n0\r\n\r\n"
	if got := readExactly(t, br, len(want)); got != want {
		t.Fatalf("the server framed a streamed response as\n%q\nwant\n%q", got, want)
	}
	if string(rendered) != pinStreamHead {
		t.Fatalf("the header rendered for a response tokentap writes is\n%q\nthe server writes\n%q", rendered, pinStreamHead)
	}
	io.WriteString(c, "GET /fixed HTTP/1.1\r\nHost: h\r\n\r\n")
	want = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
	if got := readExactly(t, br, len(want)); got != want {
		t.Fatalf("the server framed a known length as\n%q\nwant\n%q", got, want)
	}
	expectQuiet(t, c, br)
}

// What tokentap relies on when it writes a response itself: a hijack with
// no response writes nothing (not even the responses the server held back
// for pipelined requests come after it: they are flushed before); the
// connection stays open after the handler (KeepHijackedConns); what the
// server read ahead (a pipelined request) comes first through the
// hijacked connection (takeBuffered); the server reports StateHijacked
// once its goroutine let go of the connection (Proxy.connState: only then
// may it be given back, its idle tracking being keyed by the connection);
// and the server serves the connection again when given it back
// (Proxy.resume).
func TestFasthttpHijackPinned(t *testing.T) {
	back := make(chan *downstream.Conn, 1)
	hijacked := make(chan net.Conn, 4)
	var srv *fasthttp.Server
	srv, addr := pinServer(t, func(ctx *fasthttp.RequestCtx) {
		switch string(ctx.Path()) {
		case "/mine":
			cc := ctx.Conn().(*downstream.Conn)
			ctx.HijackSetNoResponse(true)
			ctx.Hijack(func(hj net.Conn) {
				io.WriteString(cc, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nmine\r\n0\r\n\r\n")
				cc.TakeBuffered(hj, make([]byte, 64))
				back <- cc
			})
		default:
			ctx.SetBodyString("server:" + string(ctx.Path()))
		}
	}, func(c net.Conn, s fasthttp.ConnState) {
		if s == fasthttp.StateHijacked {
			hijacked <- c
		}
	})
	// Three pipelined requests: one the server answers (held back in its
	// buffer for the next), one tokentap answers, and one read ahead.
	c, br := rawRequest(t, addr, "GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /mine HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n")
	c.SetDeadline(time.Now().Add(10 * time.Second))
	want := "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nserver:/a" +
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nmine\r\n0\r\n\r\n"
	if got := readExactly(t, br, len(want)); got != want {
		t.Fatalf("around a hijacked response the client read\n%q\nwant\n%q", got, want)
	}
	cc := <-back
	select {
	case c := <-hijacked:
		if c != net.Conn(cc) {
			t.Fatalf("StateHijacked reported for %v, not the hijacked connection", c)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the server never reported StateHijacked")
	}
	if !bytes.HasPrefix(cc.Pending(), []byte("GET /b HTTP/1.1\r\n")) {
		t.Fatalf("the request read ahead was not handed over: %q", cc.Pending())
	}
	expectQuiet(t, c, br) // the handler returned: the connection stays open, nothing written
	c.SetDeadline(time.Now().Add(10 * time.Second))
	done := make(chan error, 1)
	go func() { done <- srv.ServeConn(cc) }()
	want = "HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nserver:/b"
	if got := readExactly(t, br, len(want)); got != want {
		t.Fatalf("the connection given back answered\n%q\nwant\n%q", got, want)
	}
	io.WriteString(c, "GET /c HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
	want = "HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nserver:/c"
	if got := readExactly(t, br, len(want)); got != want {
		t.Fatalf("the next request on it was answered\n%q\nwant\n%q", got, want)
	}
	if err := <-done; err != nil {
		t.Fatalf("serving the connection again: %v", err)
	}
}
