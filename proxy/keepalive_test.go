package proxy

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// streamUpstream answers every request with a short chunked event stream:
// its responses are written by tokentap, and their connections given back
// to the server after them (Proxy.resume).
func streamUpstream(t *testing.T) string {
	t.Helper()
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, c := range []string{chatChunk("a"), "data: [DONE]\n\n"} {
			io.WriteString(w, c)
			flush(w)
		}
	})
	return up.URL
}

// roundTrip sends one chat request on c and reads its response whole.
func roundTrip(t *testing.T, c net.Conn, br *bufio.Reader) *http.Response {
	t.Helper()
	if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"model":"m","stream":true}`)); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

// reset closes c with a reset (SO_LINGER 0), as a client that goes away
// abruptly does.
func reset(c net.Conn) {
	_ = c.(*net.TCPConn).SetLinger(0)
	_ = c.Close()
}

// A connection that carried no request since it opened or since its last
// response has nothing to record: reset while idle, fresh or given back to
// the server after a stream tokentap wrote (the server serves it as a new
// connection), it was recorded as 400 bad_request (20 of 20). Now it is
// counted and closed, and nothing is written to it.
func TestIdleResetsLeaveNoRecord(t *testing.T) {
	for _, rp := range relayPaths {
		t.Run(rp.name, func(t *testing.T) {
			tp := startProxyOpts(t, streamUpstream(t), nil, Options{GoroutineRelay: rp.goroutine})
			before := failoverCountName(`tokentap_client_conns_closed_idle_total{reason="reset"} `)
			const each = 10
			for range each { // fresh
				c, err := net.Dial("tcp", tp.addr)
				if err != nil {
					t.Fatal(err)
				}
				time.Sleep(time.Millisecond) // accepted and waiting for a request
				reset(c)
			}
			for range each { // after a stream handed back
				c, err := net.Dial("tcp", tp.addr)
				if err != nil {
					t.Fatal(err)
				}
				if resp := roundTrip(t, c, bufio.NewReader(c)); resp.StatusCode != 200 {
					t.Fatalf("the stream: %d", resp.StatusCode)
				}
				tp.rec.next(t)
				time.Sleep(2 * time.Millisecond) // given back, waiting for the next request
				reset(c)
			}
			waitFor(t, func() error {
				if n := failoverCountName(`tokentap_client_conns_closed_idle_total{reason="reset"} `) - before; n < 2*each {
					return fmt.Errorf("%d idle resets counted, want %d", n, 2*each)
				}
				return nil
			})
			tp.rec.none(t)
		})
	}
}

// A connection given back to the server after a stream waits for its next
// request as long as any kept-alive connection (the idle timeout it was
// told in Keep-Alive), not the read timeout of a new connection's first
// byte: it was closed at request_read_timeout and recorded as a 408 with
// 0 bytes. A client that sends its next request within the advertised
// timeout, even at its very end, is served: the server waits a grace
// longer.
func TestKeptAliveConnectionsWaitTheirAdvertisedTimeout(t *testing.T) {
	for _, rp := range relayPaths {
		t.Run(rp.name, func(t *testing.T) {
			tp := startProxyOpts(t, streamUpstream(t), nil, Options{GoroutineRelay: rp.goroutine,
				RequestReadTimeout: 300 * time.Millisecond, IdleTimeout: time.Second})
			c, err := net.Dial("tcp", tp.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			br := bufio.NewReader(c)
			resp := roundTrip(t, c, br)
			if ka := resp.Header.Get("Keep-Alive"); ka != "timeout=1" {
				t.Fatalf("Keep-Alive %q, want timeout=1", ka)
			}
			tp.rec.next(t)
			// Past the read timeout, to the end of the advertised one.
			time.Sleep(time.Second)
			if resp := roundTrip(t, c, br); resp.StatusCode != 200 {
				t.Fatalf("the next request at the advertised timeout: %d", resp.StatusCode)
			}
			if r := tp.rec.next(t); r.Status != 200 {
				t.Fatalf("record %+v", r)
			}
			tp.rec.none(t)
			// Past the timeout and its grace, the connection is closed,
			// with no record and nothing written.
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			n, err := br.Read(make([]byte, 1))
			if n != 0 || err == nil {
				t.Fatalf("an idle connection past its timeout read %d bytes, %v", n, err)
			}
			tp.rec.none(t)
		})
	}
}

// A kept-alive connection whose client asked to close, or an HTTP/1.0 one,
// is told no Keep-Alive timeout.
func TestKeepAliveOnlyWhereKept(t *testing.T) {
	tp := startProxy(t, streamUpstream(t), nil)
	for _, c := range []struct {
		req  string
		want string
	}{
		{postJSON("/v1/chat/completions", `{"stream":true}`), "timeout=120"},
		{postJSON("/v1/chat/completions", `{"stream":true}`, "Connection: close"), ""},
	} {
		conn, br := rawRequest(t, tp.addr, c.req)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		conn.Close()
		if got := resp.Header.Get("Keep-Alive"); got != c.want {
			t.Errorf("Keep-Alive %q, want %q", got, c.want)
		}
		tp.rec.next(t)
	}
}

// TestKeepAliveSoak sends -soak.duration of Poisson arrivals at 60
// requests a second, in bursts, through net/http's pooled connections, to a
// tokentap whose idle timeout (3 s) the pool's idle connections often
// reach: every request the client sent has its record (matched by its
// X-Request-Id), no record is of a request the client did not send, and
// a client that keeps connections no longer than it was told (Keep-Alive:
// timeout=3) sees no error. A client that keeps them longer races the
// close it was told of; what it sees is logged.
//
//	go test -run TestKeepAliveSoak -soak -soak.duration 2m -v ./proxy
func TestKeepAliveSoak(t *testing.T) {
	if !*soak {
		t.Skip("run with -soak")
	}
	for _, told := range []bool{true, false} {
		name := map[bool]string{true: "client keeps what it was told", false: "client keeps 90 s"}[told]
		t.Run(name, func(t *testing.T) {
			ids := &idRecorder{seen: map[string]int{}}
			tp := startProxyOpts(t, streamUpstream(t), nil, Options{Sinks: []metrics.Sink{ids},
				IdleTimeout: 3 * time.Second, RequestReadTimeout: 2 * time.Second})
			idle := 90 * time.Second
			if told {
				idle = 3 * time.Second
			}
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: idle}}
			var sent, failed atomic.Int64
			var mu sync.Mutex
			var failedIDs []string
			var wg sync.WaitGroup
			deadline := time.Now().Add(*soakDuration / 2)
			for n := 0; time.Now().Before(deadline); n++ {
				// Bursts of up to 40 at once, then quiet: the pool grows,
				// and its connections idle for up to a few seconds.
				gap := time.Duration(rand.ExpFloat64() * float64(time.Second) / 60)
				if n%200 == 0 {
					gap = time.Duration(2500+rand.IntN(1000)) * time.Millisecond
				}
				time.Sleep(gap)
				burst := 1
				if n%50 == 0 {
					burst = 40
				}
				for range burst {
					id := fmt.Sprintf("soak-%d-%d", n, sent.Add(1))
					wg.Go(func() {
						req, _ := http.NewRequest("POST", tp.url+"/v1/chat/completions", strings.NewReader(`{"model":"m","stream":true}`))
						req.Header.Set("X-Request-Id", id)
						resp, err := client.Do(req)
						if err == nil {
							_, err = io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
							if err == nil && resp.StatusCode != 200 {
								err = fmt.Errorf("status %d", resp.StatusCode)
							}
						}
						if err != nil {
							failed.Add(1)
							mu.Lock()
							failedIDs = append(failedIDs, id+": "+err.Error())
							mu.Unlock()
						}
					})
				}
			}
			wg.Wait()
			time.Sleep(500 * time.Millisecond) // the last records
			unrecorded := 0
			for _, f := range failedIDs {
				if ids.count(strings.SplitN(f, ":", 2)[0]) == 0 {
					unrecorded++
				}
			}
			strays := ids.strays("soak-")
			t.Logf("%s: %d requests, %d failed at the client (%d of them without a record), %d records of no request the client sent; idle closes %d timeout, %d reset",
				name, sent.Load(), failed.Load(), unrecorded, strays,
				failoverCountName(`tokentap_client_conns_closed_idle_total{reason="timeout"} `), failoverCountName(`tokentap_client_conns_closed_idle_total{reason="reset"} `))
			for i, f := range failedIDs {
				if i < 5 {
					t.Logf("  %s", f)
				}
			}
			if strays > 0 {
				t.Errorf("%d records of no request", strays)
			}
			if told && failed.Load() > 0 {
				t.Errorf("%d errors at a client that kept its connections as long as it was told", failed.Load())
			}
		})
	}
}

// idRecorder counts records by request id.
type idRecorder struct {
	mu   sync.Mutex
	seen map[string]int
}

func (r *idRecorder) Observe(rec *metrics.Record) {
	r.mu.Lock()
	r.seen[rec.RequestID]++
	r.mu.Unlock()
}

func (r *idRecorder) count(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seen[id]
}

// strays counts the records whose id does not begin with prefix.
func (r *idRecorder) strays(prefix string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for id, c := range r.seen {
		if !strings.HasPrefix(id, prefix) {
			n += c
		}
	}
	return n
}
