package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
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
