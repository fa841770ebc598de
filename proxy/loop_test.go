package proxy

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

// A proxy's loops start with Serve and are gone after Shutdown: no loop
// goroutine and no epoll descriptor remains.
func TestShutdownStopsRelayLoops(t *testing.T) {
	polls, loopRoutines := epollDescriptors(t), relayLoopGoroutines()
	// In lockstep: the rest of the stream comes only once the client holds
	// its first event, so the stream is in a loop (passChunks moves it
	// right after that write) before the rest can be read.
	first, rest := chatChunk("first"), chatChunk("rest")
	next := make(chan struct{})
	up := startRawUpstream(t, func(c net.Conn, _ *http.Request) bool {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		fmt.Fprintf(c, "%x\r\n%s\r\n", len(first), first)
		<-next
		_, err := fmt.Fprintf(c, "%x\r\n%s\r\n0\r\n\r\n", len(rest), rest)
		return err == nil
	})
	tp := startProxy(t, up.url, nil)
	p := tp.p
	before := p.loops.Streams()
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(first))
	if _, err := io.ReadFull(resp.Body, got); err != nil {
		t.Fatal(err)
	}
	close(next)
	if b, err := io.ReadAll(resp.Body); err != nil || string(got)+string(b) != first+rest {
		t.Fatalf("the client read %q%q (%v)", got, b, err)
	}
	tp.rec.next(t)
	if p.loops.Streams() == before {
		t.Fatal("the stream did not go through a relay loop")
	}
	if n := relayLoopGoroutines(); n < loopRoutines+1 {
		t.Fatalf("%d relay loop goroutines while serving (%d before)", n, loopRoutines)
	}
	// The response was tokentap's to write: the kept-alive connection went
	// back to the server (Proxy.resume), which Shutdown closes.
	waitFor(t, func() error {
		if n := goroutinesIn("(*Proxy).resume("); n != 1 {
			return fmt.Errorf("%d goroutines serve the connection again after the stream, want 1", n)
		}
		return nil
	})
	// The server counts a connection it was just given as busy for 5 s;
	// the shutdown closes it at once as the idle connection it is.
	ctx, cancel := context.WithTimeout(context.Background(), 4500*time.Millisecond)
	defer cancel()
	if err := p.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown with an idle kept-alive connection given back to the server: %v", err)
	}
	p.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := br.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("after Shutdown the kept-alive connection read %d bytes, %v; want it closed", n, err)
	}
	waitFor(t, func() error {
		if n := goroutinesIn("(*Proxy).resume("); n != 0 {
			return fmt.Errorf("%d goroutines still serve a connection after Shutdown", n)
		}
		return nil
	})
	// The proxy's own loops are gone (Stop returns once each loop's
	// goroutine has closed its descriptors and returned), and the process
	// holds no more loop goroutines or epoll descriptors than before: a
	// loop an earlier test's proxy still ran may have ended meanwhile (the
	// counts are the process's), so fewer is no leak.
	if n := p.loops.Running(); n != 0 {
		t.Fatalf("%d relay loops still running after Shutdown", n)
	}
	if n := relayLoopGoroutines(); n > loopRoutines {
		t.Fatalf("%d relay loop goroutines after Shutdown, %d before", n, loopRoutines)
	}
	if n := epollDescriptors(t); n > polls {
		t.Fatalf("%d epoll descriptors after Shutdown, %d before", n, polls)
	}
}

// relayLoopGoroutines counts the goroutines running a relay loop.
func relayLoopGoroutines() int { return goroutinesIn("relayplane.(*Loop).run(") }

// goroutinesIn counts the goroutines whose stack holds fn.
func goroutinesIn(fn string) int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), fn)
		}
		buf = make([]byte, 2*len(buf))
	}
}

// epollDescriptors counts the process's open epoll descriptors (the
// runtime's own included).
func epollDescriptors(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && l == "anon_inode:[eventpoll]" {
			n++
		}
	}
	return n
}
