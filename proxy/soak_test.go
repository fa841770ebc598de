package proxy

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

var (
	soak         = flag.Bool("soak", false, "run the soak test (not in CI)")
	soakDuration = flag.Duration("soak.duration", 30*time.Minute, "how long the soak runs")
	soakStreams  = flag.Int("soak.streams", 500, "concurrent streams in the soak")
)

// outcomeCounter is a sink counting records by outcome.
type outcomeCounter struct {
	mu sync.Mutex
	n  map[metrics.Outcome]int
}

func (o *outcomeCounter) Observe(r *metrics.Record) {
	o.mu.Lock()
	o.n[r.Outcome]++
	o.mu.Unlock()
}

func (o *outcomeCounter) get() map[metrics.Outcome]int {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := map[metrics.Outcome]int{}
	for k, v := range o.n {
		out[k] = v
	}
	return out
}

// TestSoak holds -soak.streams streams through the proxy for
// -soak.duration: one client in ten reads slowly, 1% of requests are reset
// by the upstream mid-stream and 1% aborted by their client. Memory and
// goroutines must be flat over the second half, and at the end every
// request has exactly one record with the outcome its client saw.
//
//	go test -run TestSoak -soak -soak.duration 30m -timeout 40m -v ./proxy
func TestSoak(t *testing.T) {
	if !*soak {
		t.Skip("run with -soak")
	}
	const events, gap = 40, 25 * time.Millisecond
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		reset := r.Header.Get("X-Soak-Reset") != ""
		for k := 0; k < events; k++ {
			if reset && k == events/2 {
				c, _, err := w.(http.Hijacker).Hijack()
				if err == nil {
					c.(*net.TCPConn).SetLinger(0)
					c.Close()
				}
				return
			}
			io.WriteString(w, chatChunk("tok"))
			flush(w)
			time.Sleep(gap)
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	counts := &outcomeCounter{n: map[metrics.Outcome]int{}}
	tp := startProxyOpts(t, up.URL, nil, Options{Sinks: []metrics.Sink{counts}})

	var sent, completed, aborted, broken atomic.Int64
	deadline := time.Now().Add(*soakDuration)
	var wg sync.WaitGroup
	for i := 0; i < *soakStreams; i++ {
		wg.Add(1)
		go func(slow bool) {
			defer wg.Done()
			for time.Now().Before(deadline) {
				roll := rand.IntN(100)
				reset, abort := roll == 0, roll == 1
				extra := []string{}
				if reset {
					extra = append(extra, "X-Soak-Reset: 1")
				}
				c, err := net.Dial("tcp", tp.addr)
				if err != nil {
					t.Errorf("dial: %v", err)
					return
				}
				sent.Add(1)
				io.WriteString(c, strings.Replace(postJSON("/v1/chat/completions", `{"stream":true}`, extra...), "Host: tokentap.test\r\n", "Host: tokentap.test\r\nConnection: close\r\n", 1))
				br := bufio.NewReader(c)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					broken.Add(1)
					c.Close()
					continue
				}
				buf := make([]byte, 512)
				got := 0
				var rerr error
				for {
					if slow {
						time.Sleep(5 * time.Millisecond)
					}
					var n int
					n, rerr = resp.Body.Read(buf)
					got += n
					if abort && got > 1000 {
						break
					}
					if rerr != nil {
						break
					}
				}
				c.Close()
				switch {
				case abort:
					aborted.Add(1)
				case rerr == io.EOF:
					completed.Add(1)
				default:
					broken.Add(1)
				}
			}
		}(i%10 == 0)
	}

	type sample struct {
		at         time.Duration
		goroutines int
		heap       uint64
	}
	var samples []sample
	start := time.Now()
	for time.Now().Before(deadline) {
		time.Sleep(min(10*time.Second, *soakDuration/20))
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		s := sample{time.Since(start), runtime.NumGoroutine(), ms.HeapInuse}
		samples = append(samples, s)
		t.Logf("%6.0fs: %d goroutines, heap %.1f MiB, %d requests", s.at.Seconds(), s.goroutines, float64(s.heap)/(1<<20), sent.Load())
	}
	wg.Wait()
	// Every record is written once the last stream ends.
	total := func() int {
		n := 0
		for _, v := range counts.get() {
			n += v
		}
		return n
	}
	waitUntil(t, func() bool { return int64(total()) >= sent.Load() })
	got := counts.get()
	t.Logf("sent %d: completed %d, aborted %d, broken %d; records %v", sent.Load(), completed.Load(), aborted.Load(), broken.Load(), got)
	if int64(total()) != sent.Load() {
		t.Errorf("%d records for %d requests", total(), sent.Load())
	}
	if int64(got[metrics.OutcomeOK]) != completed.Load() || int64(got[metrics.OutcomeClientCancel]) != aborted.Load() ||
		int64(got[metrics.OutcomeUpstreamError]) != broken.Load() {
		t.Errorf("accounting: records %v, clients saw %d complete, %d aborted, %d broken", got, completed.Load(), aborted.Load(), broken.Load())
	}
	// Flat over the second half: the last samples no higher than the
	// midpoint's by more than a margin.
	if len(samples) >= 4 {
		mid := samples[len(samples)/2]
		var maxG int
		var maxH uint64
		for _, s := range samples[len(samples)/2:] {
			maxG, maxH = max(maxG, s.goroutines), max(maxH, s.heap)
		}
		if float64(maxG) > 1.1*float64(mid.goroutines)+20 || float64(maxH) > 1.25*float64(mid.heap)+8<<20 {
			t.Errorf("growth over the second half: goroutines %d → max %d, heap %.1f → max %.1f MiB",
				mid.goroutines, maxG, float64(mid.heap)/(1<<20), float64(maxH)/(1<<20))
		}
		fmt.Printf("soak: %v, %d streams, %d requests; second half: goroutines %d → max %d, heap %.1f → max %.1f MiB\n",
			*soakDuration, *soakStreams, sent.Load(), mid.goroutines, maxG, float64(mid.heap)/(1<<20), float64(maxH)/(1<<20))
	}
}
