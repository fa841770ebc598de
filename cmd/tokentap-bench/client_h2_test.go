package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The bench's h2c client speaks HTTP/2 with prior knowledge: 20 streamed
// requests at once share a connection, each with its tokens stamped and
// counted; a server that answers HTTP/1.1 only fails them.
func TestH2CClient(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns sync.Map
	var streams atomic.Int32
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	srv := &http.Server{Protocols: &p, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor != 2 || r.Header.Get("X-Request-Id") == "" {
			http.Error(w, "HTTP/2 with an id, please", http.StatusBadRequest)
			return
		}
		conns.Store(r.RemoteAddr, true)
		streams.Add(1)
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 5 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"t%d\"}}]}\n\n", i)
			w.(http.Flusher).Flush()
			time.Sleep(2 * time.Millisecond)
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})}
	go srv.Serve(ln)
	defer srv.Close()
	cl, err := newClient("h2c://"+ln.Addr().String()+"/v1/chat/completions", nil, 5*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.closeIdle()
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Go(func() {
			r := cl.do(fmt.Sprintf("r%d", i), []byte(`{}`), false)
			if r.Err != "" || r.Status != 200 || len(r.Tokens) != 5 || r.TTFT <= 0 || r.E2E < r.TTFT || r.Output != 5 {
				t.Errorf("request %d: %+v", i, r)
			}
		})
	}
	wg.Wait()
	n := 0
	conns.Range(func(any, any) bool { n++; return true })
	if streams.Load() != 20 || n > 2 {
		t.Fatalf("%d streams on %d connections", streams.Load(), n)
	}

	var h1only http.Protocols
	h1only.SetHTTP1(true)
	plain := &http.Server{Protocols: &h1only, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {})}
	ln2, _ := net.Listen("tcp", "127.0.0.1:0")
	go plain.Serve(ln2)
	defer plain.Close()
	cl2, _ := newClient("h2c://"+ln2.Addr().String()+"/", nil, 2*time.Second, nil)
	if r := cl2.do("x", []byte(`{}`), false); r.Err == "" {
		t.Fatalf("an HTTP/1.1-only server answered an h2c client: %+v", r)
	}
}
