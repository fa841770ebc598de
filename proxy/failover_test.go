package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

func failoverCount(route, from, reason string) int {
	return failoverCountName(fmt.Sprintf(`tokentap_failovers_total{route=%q,from=%q,reason=%q} `, route, from, reason))
}

// failoverCountName reads a process-wide counter by its name and labels.
func failoverCountName(name string) int {
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, line := range strings.Split(b.String(), "\n") {
		if v, ok := strings.CutPrefix(line, name); ok {
			var n int
			fmt.Sscan(v, &n)
			return n
		}
	}
	return 0
}

// TestFailover sends each request first to a failing upstream (weight
// 100 against 1) and checks that it reaches the healthy one: the client
// gets one clean answer, the record one line with attempts 2, the final
// upstream and the time lost, and the counter its reason.
func TestFailover(t *testing.T) {
	wait.Long(t, "failovers over loopback")
	healthy := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	closed := func() string { // a port nothing listens on
		ln, _ := net.Listen("tcp", "127.0.0.1:0")
		addr := ln.Addr().String()
		ln.Close()
		return "http://" + addr
	}()
	failing := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.WriteHeader(http.StatusServiceUnavailable)
		io.WriteString(w, `{"error":"overloaded"}`)
	})
	queueing := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		// Headers at once, the first byte of the body only much later: a
		// backend that accepted the request and queues it.
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		flush(w)
		select {
		case <-r.Context().Done():
		case <-time.After(3 * time.Second):
			io.WriteString(w, chatChunk("late"))
		}
	})
	for _, c := range []struct {
		reason, bad string
		timeout     time.Duration
	}{
		{FailoverConnect, closed, 0},
		{FailoverStatus5xx, failing.URL, 0},
		{FailoverFirstToken, queueing.URL, 150 * time.Millisecond},
	} {
		t.Run(c.reason, func(t *testing.T) {
			route := "fo-" + c.reason
			tp := startProxy(t, "", func(cfg *Config) {
				cfg.Routes = []Route{{Name: route, Prefix: "/", Timeouts: DefaultTimeouts,
					Upstreams: []Upstream{{Name: "bad", URL: c.bad, Weight: 100}, {Name: "good", URL: healthy, Weight: 1}},
					Failover:  &Failover{On: []string{c.reason}, FirstTokenTimeout: c.timeout}}}
			})
			before := failoverCount(route, "bad", c.reason)
			failedOver := 0
			for range 6 {
				resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(streamChat))
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || !bytes.Contains(body, []byte("[DONE]")) || bytes.Contains(body, []byte("late")) {
					t.Fatalf("status %d, body %q", resp.StatusCode, body)
				}
				r := tp.rec.next(t)
				if r.Upstream != "good" || r.Outcome != metrics.OutcomeOK || r.Events == 0 {
					t.Errorf("record upstream %q outcome %s events %d", r.Upstream, r.Outcome, r.Events)
				}
				if r.Attempts == 2 {
					failedOver++
					// The time lost on the first upstream is the backends', not
					// tokentap's overhead (which would then be at least as long as
					// the first-token timeout's wait).
					if r.FailoverWait < c.timeout || c.timeout > 0 && r.Overhead >= r.FailoverWait {
						t.Errorf("failover wait %v, overhead %v", r.FailoverWait, r.Overhead)
					}
					if c.timeout > 0 && r.TTFT < c.timeout {
						t.Errorf("TTFT %v counts the wait for the first upstream (%v)", r.TTFT, c.timeout)
					}
				}
			}
			if failedOver < 4 {
				t.Errorf("%d of 6 requests failed over", failedOver)
			}
			if got := failoverCount(route, "bad", c.reason) - before; got != failedOver {
				t.Errorf("tokentap_failovers_total grew by %d, want %d", got, failedOver)
			}
		})
	}
}

// TestNoFailoverAfterAByteWentOut: a stream that breaks after its first
// event is not sent again: the client has bytes of it.
func TestNoFailoverAfterAByteWentOut(t *testing.T) {
	healthy := startMock(t, mockllm.Options{PrefillBase: 5 * time.Millisecond, TokenGap: time.Millisecond})
	breaking := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("one"))
		flush(w)
		panic(http.ErrAbortHandler) // the connection breaks mid-stream
	})
	tp := startProxy(t, "", func(cfg *Config) {
		cfg.Routes = []Route{{Name: "fo-late", Prefix: "/", Timeouts: DefaultTimeouts,
			Upstreams: []Upstream{{Name: "bad", URL: breaking.URL, Weight: 1}, {Name: "good", URL: healthy, Weight: 0}},
			Failover:  &Failover{On: []string{FailoverConnect, FailoverStatus5xx, FailoverFirstToken}, FirstTokenTimeout: time.Second}}}
	})
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(streamChat))
	if err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	r := tp.rec.next(t)
	if r.Upstream != "bad" || r.Attempts != 1 || r.Outcome != metrics.OutcomeUpstreamError {
		t.Errorf("record upstream %q attempts %d outcome %s", r.Upstream, r.Attempts, r.Outcome)
	}
}
