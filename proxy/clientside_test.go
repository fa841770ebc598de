package proxy

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

// Many streams end at once: every record comes once, with what its client
// acknowledged, and the watch that waited for them stops.
func TestAckWatchManyStreamsAtOnce(t *testing.T) {
	const streams = 30
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 5 {
			io.WriteString(w, chatChunk(strings.Repeat("t", 100*i+1)))
			flush(w)
		}
	})
	tp := startProxy(t, up.URL, nil)
	var wg sync.WaitGroup
	conns := make(chan net.Conn, streams)
	// Each client sends its requests one after another on one connection:
	// past a new connection's first segments, which the client's kernel
	// acknowledges at once, its ACKs are delayed, so records wait.
	const each = 4
	for range streams {
		wg.Go(func() {
			c, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`))
			for i := range each {
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				if i < each-1 {
					io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`))
				}
			}
			conns <- c // kept open and quiet: no request after the last carries an ACK
		})
	}
	wg.Wait()
	ids := map[string]bool{}
	for range streams * each {
		r := tp.rec.next(t)
		if ids[r.RequestID] {
			t.Fatalf("%s recorded twice", r.RequestID)
		}
		ids[r.RequestID] = true
		if r.BytesWire == 0 || r.BytesAcked != r.BytesWire || r.Unacked {
			t.Errorf("%s: bytes_acked %d of %d written, unacked %v", r.RequestID, r.BytesAcked, r.BytesWire, r.Unacked)
		}
	}
	tp.rec.none(t)
	waitFor(t, func() error {
		if n, running := tp.p.waiting.Waiting(); running || n > 0 {
			return fmt.Errorf("the watch still runs with %d waiting", n)
		}
		return nil
	})
}

// One-token streams, each relayed in one write, on a kept-alive
// connection whose client (net/http's) sends its next request 5 ms after
// each response: once the client's kernel holds its acknowledgements
// (Linux's interactive mode), it acknowledges each response with the next
// request. The first token reached it a loopback round trip after it was
// written, so client_ttft_ms is ttft_ms and the RTT, within measure.AckAgree, for
// every response after the connection's first. Reading the next request's
// acknowledgement as the token's arrival put 3 to 9 of the 11 about 5 ms
// late.
func TestOneWriteStreamsOnAKeptConnection(t *testing.T) {
	mock := startMock(t, mockllm.Options{PrefillBase: 20 * time.Millisecond, TokenGap: time.Millisecond, MaxTokens: 1})
	tp := startProxy(t, mock, nil)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}}
	const n = 12
	for i := range n {
		resp, err := client.Post("http://"+tp.addr+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"m","stream":true,"max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := io.ReadAll(resp.Body); !strings.Contains(string(b), "[DONE]") {
			t.Fatalf("response %d: %q", i, b)
		}
		resp.Body.Close()
		// The client's pause: its next request carries its acknowledgement.
		time.Sleep(5 * time.Millisecond)
	}
	for i := range n {
		rec := tp.rec.next(t)
		if rec.TTFT < 0 || rec.ClientTTFT < 0 || rec.ClientRTT < 0 {
			t.Fatalf("response %d: ttft %v, client ttft %v, rtt %v", i, rec.TTFT, rec.ClientTTFT, rec.ClientRTT)
		}
		if off := rec.ClientTTFT - rec.TTFT - rec.ClientRTT; i > 0 && (off > measure.AckAgree || off < -measure.AckAgree) {
			t.Errorf("response %d: client_ttft_ms %.3f, ttft_ms %.3f and the RTT %.3f: %.3f ms off", i, ms(rec.ClientTTFT), ms(rec.TTFT), ms(rec.ClientRTT), ms(off))
		}
	}
}
