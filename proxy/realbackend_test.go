package proxy

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tidwall/gjson"
	"github.com/tokentap/tokentap/metrics"
)

// TestRealLlamaServer runs 500 mixed requests through tokentap to
// llama.cpp's own server (LLAMA_SERVER_URL, e.g. http://127.0.0.1:8077 as
// ../shared/realbackend's start.sh runs it; the test skips without it):
// streamed chats with and without usage, whole answers, and prompts over
// the server's context, four at a time, back to back on kept-alive
// connections. The server announces keep-alive and closes after every
// streamed response, so a connection handed to the next request can close
// under it: tokentap must turn none of this into an error the server did
// not send, its tokens must equal the server's usage, and the server's
// timings must be joined to the records.
func TestRealLlamaServer(t *testing.T) {
	base := os.Getenv("LLAMA_SERVER_URL")
	if base == "" {
		t.Skip("LLAMA_SERVER_URL is not set: start llama.cpp's server (../shared/realbackend/start.sh) and set it to its URL")
	}
	tp := startProxy(t, strings.TrimRight(base, "/"), nil)
	long := strings.Repeat("hello there ", 1500) // past the 2048 tokens of a slot
	kinds := []struct {
		name, body string
		stream     bool
		status     int
	}{
		{"stream+usage", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,"messages":[{"role":"user","content":"hi %d"}]}`, true, 200},
		{"stream", `{"model":"m","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"tell me %d"}]}`, true, 200},
		{"whole", `{"model":"m","max_tokens":%d,"messages":[{"role":"user","content":"answer %d"}]}`, false, 200},
		{"over context", `{"model":"m","max_tokens":%d,"messages":[{"role":"user","content":"` + long + ` %d"}]}`, false, 400},
	}
	const n, workers = 500, 4
	type result struct {
		kind   int
		status int
		id     string
		body   []byte
		err    error
	}
	results := make(chan result, n)
	jobs := make(chan int, n)
	for i := range n {
		jobs <- i
	}
	close(jobs)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: 2 * time.Minute}
			for i := range jobs {
				k := i % len(kinds)
				body := fmt.Sprintf(kinds[k].body, 8+i%24, i)
				resp, err := client.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					results <- result{kind: k, err: err}
					continue
				}
				b, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				results <- result{kind: k, status: resp.StatusCode, id: resp.Header.Get("X-Request-Id"), body: b, err: err}
			}
		}()
	}
	wg.Wait()
	close(results)
	recs := map[string]metrics.Record{}
	for range n {
		r := tp.rec.next(t)
		recs[r.RequestID] = r
	}
	var failed, mismatched, untimed int
	byKind := make([]int, len(kinds))
	for res := range results {
		k := kinds[res.kind]
		rec, ok := recs[res.id]
		switch {
		case res.err != nil:
			failed++
			t.Errorf("%s: %v", k.name, res.err)
			continue
		case bytes.Contains(res.body, []byte("tokentap_error")) || res.status != k.status || !ok:
			failed++
			t.Errorf("%s: status %d (want %d), record found %v: %.200s", k.name, res.status, k.status, ok, res.body)
			continue
		}
		byKind[res.kind]++
		if k.status != 200 {
			continue
		}
		// The server's own count of what it generated, as the client got it.
		var want int64
		if k.stream {
			for _, line := range bytes.Split(res.body, []byte("\n")) {
				data, ok := bytes.CutPrefix(line, []byte("data: "))
				if !ok {
					continue
				}
				if u := gjson.GetBytes(data, "usage.completion_tokens"); u.Exists() {
					want = u.Int()
				} else if p := gjson.GetBytes(data, "timings.predicted_n"); p.Exists() && want == 0 {
					want = p.Int()
				}
			}
		} else {
			want = gjson.GetBytes(res.body, "usage.completion_tokens").Int()
		}
		if int64(rec.OutputTokens) != want || want == 0 || rec.Outcome != metrics.OutcomeOK {
			mismatched++
			t.Errorf("%s: record %d output tokens (%s), outcome %s; the server says %d", k.name, rec.OutputTokens, rec.TokensSource, rec.Outcome, want)
		}
		if rec.ServerPrefill == metrics.Absent || rec.ServerDecode == metrics.Absent {
			untimed++
			t.Errorf("%s: the server's timings are not in the record (prefill %v, decode %v)", k.name, rec.ServerPrefill, rec.ServerDecode)
		}
	}
	t.Logf("%d requests through tokentap to %s: %v by kind (%s, %s, %s, %s); %d failed, %d token mismatches, %d without timings",
		n, base, byKind, kinds[0].name, kinds[1].name, kinds[2].name, kinds[3].name, failed, mismatched, untimed)
}

// TestRealLlamaServerOverload offers llama.cpp's own server
// (LLAMA_SERVER_URL) three times its capacity through tokentap shedding by
// TTFT 500 ms and TPOT 50 ms: the capacity measured first (32 requests
// at once, straight to it), then Poisson arrivals for 5 s of warm-up and
// 15 s counted. Goodput is kept at 60% of the capacity at least (forwarding
// everything keeps none: its queue grows by twice the capacity a second),
// every refusal comes with Retry-After, and nothing fails but what was
// shed.
func TestRealLlamaServerOverload(t *testing.T) {
	base := os.Getenv("LLAMA_SERVER_URL")
	if base == "" {
		t.Skip("LLAMA_SERVER_URL is not set: start llama.cpp's server (../shared/realbackend/start.sh) and set it to its URL")
	}
	base = strings.TrimRight(base, "/")
	const body = `{"model":"m","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"tell me a story"}]}`
	// The capacity: completions a second with the server busy throughout.
	var done atomic.Int64
	var wg sync.WaitGroup
	stop := time.Now().Add(8 * time.Second)
	for range 32 {
		wg.Go(func() {
			client := &http.Client{Timeout: time.Minute}
			for time.Now().Before(stop) {
				resp, err := client.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == 200 && time.Now().Before(stop) {
					done.Add(1)
				}
			}
		})
	}
	wg.Wait()
	capacity := float64(done.Load()) / 8
	if capacity < 1 {
		t.Fatalf("the server served %d requests in 8 s", done.Load())
	}
	tp := startProxyRecords(t, base, func(c *Config) {
		c.SLO = metrics.SLO{TTFT: 500 * time.Millisecond, TPOT: 50 * time.Millisecond}
		c.Routes[0].Overload = &Overload{Shed: true}
	}, Options{}, 10000)
	rng := rand.New(rand.NewPCG(11, 7))
	w := offer(t, tp, body, 3*capacity, 5*time.Second, 0, rng)
	for range w.arrivals {
		tp.rec.next(t)
	}
	const d = 15 * time.Second
	tl := offer(t, tp, body, 3*capacity, d, 0, rng)
	countRecords(t, tp, tl, tl.arrivals)
	good := float64(tl.good) / d.Seconds()
	t.Logf("capacity %.1f/s; at 3x: %d requests, %d good (%.1f/s), %d shed, %d transport errors; sheds answered p99 %v",
		capacity, tl.sent, tl.good, good, tl.shed, tl.others, p99(tl.shedAnswer))
	if good < 0.6*capacity || tl.shed == 0 || tl.missingRetryAfter > 0 || tl.others > 0 || tl.failed > 0 {
		t.Errorf("at 3x capacity: %.1f good/s of %.1f, %d shed (%d without Retry-After), %d transport errors, %d failed otherwise", good, capacity, tl.shed, tl.missingRetryAfter, tl.others, tl.failed)
	}
}

func p99(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)*99/100]
}

// TestRealLlamaServersStickyPrefix: two of llama.cpp's servers
// (LLAMA_SERVER_URL and LLAMA_SERVER_URL2, each of 4 slots that keep
// their last prompt's cache), 8 system prompts of about 1,300 tokens, 160
// requests two at a time. Sent by fewest in flight, every server sees
// every prompt and its slots keep losing them; by prompt prefix, each
// server sees half and keeps them: the first token comes sooner at the
// median, and the servers report more cached tokens.
func TestRealLlamaServersStickyPrefix(t *testing.T) {
	a, b := os.Getenv("LLAMA_SERVER_URL"), os.Getenv("LLAMA_SERVER_URL2")
	if a == "" || b == "" {
		t.Skip("LLAMA_SERVER_URL and LLAMA_SERVER_URL2 are not set: start two of llama.cpp's servers (../shared/realbackend/start.sh, PORT=8078 for the second)")
	}
	prompts := make([]string, 8)
	for i := range prompts {
		prompts[i] = fmt.Sprintf("System %d. ", i) + strings.Repeat(fmt.Sprintf("rule %d says be brief and kind. ", i), 150)
	}
	run := func(sticky string) (ttftP50 time.Duration, cached int) {
		tp := startProxy(t, "", func(c *Config) {
			c.Routes = []Route{{Name: "pair", Prefix: "/", Timeouts: DefaultTimeouts, Balance: BalanceLeastInflight, Sticky: sticky,
				Upstreams: []Upstream{{Name: "a", URL: strings.TrimRight(a, "/"), Weight: 1}, {Name: "b", URL: strings.TrimRight(b, "/"), Weight: 1}}}}
		})
		rng := rand.New(rand.NewPCG(3, 3))
		const n = 160
		work := make(chan string, n)
		for i := range n {
			work <- fmt.Sprintf(`{"model":"m","stream":true,"max_tokens":4,"stream_options":{"include_usage":true},"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`,
				prompts[rng.IntN(len(prompts))], i)
		}
		close(work)
		var wg sync.WaitGroup
		for range 2 {
			wg.Go(func() {
				for body := range work {
					resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
					if err != nil {
						t.Error(err)
						continue
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
		wg.Wait()
		var ttfts []time.Duration
		for range n {
			r := tp.rec.next(t)
			if r.TTFT > 0 {
				ttfts = append(ttfts, r.TTFT)
			}
			cached += max(r.CachedTokens, 0)
		}
		slices.Sort(ttfts)
		return ttfts[len(ttfts)/2], cached
	}
	without, cachedWithout := run("")
	with, cachedWith := run(StickyPrefix)
	t.Logf("TTFT p50: least_inflight %v (%d tokens cached), sticky prefix %v (%d cached)", without, cachedWithout, with, cachedWith)
	if with >= without || cachedWith <= cachedWithout {
		t.Errorf("sticky prefix: TTFT p50 %v and %d cached tokens, against %v and %d without it", with, cachedWith, without, cachedWithout)
	}
}
