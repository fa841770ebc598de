package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/tokentap/tokentap/metrics"
)

// heldUpstream answers each request with a chunked stream's header and
// first event, then holds the stream open until the connection closes:
// a backend in a long pause. It keeps next to nothing per connection, so
// that the heap it adds to the test's is small beside the proxy's.
func heldUpstream(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	event := chatChunk("first")
	first := "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
		fmt.Sprintf("%x\r\n%s\r\n", len(event), event)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				var buf [512]byte
				var seen []byte
				for !bytes.Contains(seen, []byte("\r\n\r\n")) {
					n, err := c.Read(buf[:])
					if err != nil {
						return
					}
					seen = append(seen, buf[:n]...)
				}
				if _, err := io.WriteString(c, first); err != nil {
					return
				}
				for { // the body, then nothing until the proxy closes
					if _, err := c.Read(buf[:]); err != nil {
						return
					}
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// liveHeap is the heap in use by live objects, after a collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// settledHeap is liveHeap once what earlier tests left behind has gone
// (their connections closing, their records): two readings 20 ms apart
// within 32 KiB of each other, or the last of 100.
func settledHeap() int64 {
	h := liveHeap()
	for range 100 {
		time.Sleep(20 * time.Millisecond)
		next := liveHeap()
		if d := next - h; d > -32<<10 && d < 32<<10 {
			return next
		}
		h = next
	}
	return h
}

// An open stream waiting for its backend holds no goroutine and no
// buffer that only moving bytes need: on a relay loop, the hijack's
// goroutine has returned (and the server's 16 KiB read buffer with it),
// the relay's read buffer is lent back to the loop and the upstream
// connection's reader put aside, the upstream request given back
// (letRequestGo) and the response header it wrote let go. Before, a
// stream held one goroutine and about 50 KB of heap (8.7 to 9.2 KB now,
// 11.9 with the request and the header held); the bound is 11 KB, with the
// test's own client and backend connections counted in.
func TestIdleStreamsHoldLittle(t *testing.T) {
	const streams = 200
	tp := startProxy(t, heldUpstream(t), nil)
	req := postJSON("/v1/chat/completions", `{"model":"m","stream":true}`)
	open := func() net.Conn {
		t.Helper()
		c, err := net.Dial("tcp", tp.addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.WriteString(c, req); err != nil {
			t.Fatal(err)
		}
		var buf [2048]byte
		var got []byte
		for !bytes.Contains(got, []byte("data:")) {
			n, err := c.Read(buf[:])
			if err != nil {
				t.Fatalf("stream: %v after %q", err, got)
			}
			got = append(got, buf[:n]...)
		}
		c.SetDeadline(time.Time{})
		return c
	}
	// One stream first: the proxy's pools and loops are warm, its
	// fixed costs are in the baseline.
	warm := open()
	defer warm.Close()
	base := settledHeap()
	conns := make([]net.Conn, 0, streams)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range streams {
		conns = append(conns, open())
	}
	// The last stream's move into its loop may still be under way.
	waitFor(t, func() error {
		if relaying := goroutinesIn("relay.(*Body).relayPass("); relaying > 0 {
			return fmt.Errorf("%d goroutines relay open streams, want none (the loops hold them)", relaying)
		}
		return nil
	})
	perStream := float64(settledHeap()-base) / streams
	t.Logf("heap per open stream: %.0f bytes", perStream)
	if perStream > 11<<10 {
		t.Fatalf("an open stream holds %.0f bytes of heap, want at most %d", perStream, 11<<10)
	}
}

// The relay loops watch each waiting request's client for its close and
// let go of the socket when its connection ends: after requests of every
// kind (answered, streamed, and one whose client left), no watch is under
// way, the one kept-alive connection still open holds at most its seat,
// and once it closed each loop's epoll set holds only its own eventfd and
// every watch slot is free.
func TestLoopPeerWatchLeavesNothingBehind(t *testing.T) {
	slowStarted := make(chan struct{})
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		if r.URL.Path == "/slow" {
			close(slowStarted)
			select {
			case <-r.Context().Done():
			case <-time.After(time.Minute):
			}
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a"))
		flush(w)
		time.Sleep(20 * time.Millisecond) // past the watch's start on either path
		io.WriteString(w, chatChunk("b"))
	})
	tp := startProxy(t, up.URL, nil)
	// One keep-alive connection, open until the end: a socket left in a
	// set would still be there (a closed one leaves by itself).
	addErrors := failoverCountName(`tokentap_relay_loop_errors_total{op="add"} `)
	keep, br := rawRequest(t, tp.addr, "")
	for range 10 {
		io.WriteString(keep, postJSON("/v1/chat/completions", `{"stream":true}`))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		if b, err := io.ReadAll(resp.Body); err != nil || string(b) != chatChunk("a")+chatChunk("b") {
			t.Fatalf("stream: %q, %v", b, err)
		}
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK {
			t.Fatalf("record: %s", rec.Outcome)
		}
	}
	if tp.p.loops.Running() == 0 {
		t.Skip("no relay loop on this system")
	}
	// The streams moved into a loop (all but any whose two events came in
	// one read on a busy machine), each socket's seat given up for it: a
	// socket is in an epoll set once, and a loop that met its seat there
	// would have refused the stream (an epoll_ctl add error).
	if n := tp.p.loops.Streams(); n == 0 {
		t.Fatal("no stream was relayed by a loop")
	}
	if n := failoverCountName(`tokentap_relay_loop_errors_total{op="add"} `) - addErrors; n != 0 {
		t.Fatalf("%d sockets the loops could not add", n)
	}
	c, _ := rawRequest(t, tp.addr, postJSON("/slow", `{"stream":true}`))
	<-slowStarted // the request waits at the backend, its client watched
	c.Close()
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("the request whose client left: %s", rec.Outcome)
	}
	// The connection that left may still be closing on the server's side.
	waitSeats(t, tp, 1)
	keep.Close()
	waitSeats(t, tp, 0)
}

// waitSeats waits until the loops hold at most max seats and nothing else
// a quiet loop must not hold.
func waitSeats(t *testing.T, tp *testProxy, max int) {
	t.Helper()
	waitFor(t, func() error {
		seats, err := tp.p.loops.Idle()
		if err == nil && seats > max {
			err = fmt.Errorf("%d seats, want at most %d", seats, max)
		}
		return err
	})
}

// A kept-alive connection's socket is registered in a loop's epoll set by
// its first request's peer watch and stays there: its later requests
// make no epoll_ctl, and the loop still cancels one whose client leaves.
func TestKeptAliveConnectionSeatedOnce(t *testing.T) {
	slowStarted := make(chan struct{}, 1)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		if r.URL.Path == "/slow" {
			slowStarted <- struct{}{}
			<-r.Context().Done()
			return
		}
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	})
	tp := startProxy(t, up.URL, nil)
	before := tp.p.loops.Registered()
	keep, br := rawRequest(t, tp.addr, "")
	for range 20 {
		io.WriteString(keep, postJSON("/v1/chat/completions", `{}`))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeOK {
			t.Fatalf("record: %s", rec.Outcome)
		}
	}
	if tp.p.loops.Running() == 0 {
		t.Skip("no relay loop on this system")
	}
	if n := tp.p.loops.Registered() - before; n != 1 {
		t.Fatalf("20 requests on one connection registered its socket %d times, want 1", n)
	}
	if seats, err := tp.p.loops.Idle(); seats != 1 || err != nil {
		t.Fatalf("between requests: %d seats (want 1), %v", seats, err)
	}
	// Its next request's client leaves while it waits: seen from the seat.
	io.WriteString(keep, postJSON("/slow", `{}`))
	<-slowStarted
	keep.Close()
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("the request whose client left: %s", rec.Outcome)
	}
	if n := tp.p.loops.Registered() - before; n != 1 {
		t.Fatalf("21 requests on one connection registered its socket %d times, want 1", n)
	}
	waitSeats(t, tp, 0)
}

// What an open stream holds in memory is mostly its exchange (pooled, one
// per request in flight) and the marks waiting for its first tokens'
// acknowledgement: their sizes are bounds, kept here (an allocation's
// size class is what a stream pays: 3,072 bytes, since the reader model
// of how the stream read came in (2,936 bytes; 2,816 before); the marks'
// bound is measure's).
func TestOpenStreamStructSizes(t *testing.T) {
	for _, c := range []struct {
		name      string
		size, max uintptr
	}{
		{"exchange", unsafe.Sizeof(exchange{}), 3072},
	} {
		if c.size > c.max {
			t.Errorf("%s is %d bytes, bound %d", c.name, c.size, c.max)
		}
	}
}
