package mockllm

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

func ttft(t *testing.T, url, body string) time.Duration {
	t.Helper()
	start := time.Now()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	resp.Body.Read(buf)
	d := time.Since(start)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return d
}

// Prefill grows with the prompt and shrinks when its prefix is cached.
func TestPrefillAndPrefixCache(t *testing.T) {
	s := httptest.NewServer(New(Options{PrefillBase: time.Millisecond, PrefillPerToken: 20 * time.Microsecond, PrefixCache: true, MaxTokens: 1}))
	defer s.Close()
	long := strings.Repeat("x", 20000) // 5000 tokens: 100 ms of prefill
	body := func(suffix string) string {
		return `{"stream":true,"messages":[{"role":"user","content":"` + long + suffix + `"}]}`
	}
	fresh := ttft(t, s.URL, body("a"))
	// A busy machine only adds: the cached prefill is the fastest of three.
	cached := time.Hour
	for _, suffix := range []string{"b", "c", "d"} {
		cached = min(cached, ttft(t, s.URL, body(suffix)))
	}
	if fresh < 100*time.Millisecond || cached > fresh/3 {
		t.Fatalf("fresh prefill %v, cached %v", fresh, cached)
	}
	// The usage says how much of the prompt was cached, as OpenAI and
	// vLLM do.
	resp, err := http.Post(s.URL+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true,"messages":[{"role":"user","content":"`+long+`e"}],"stream_options":{"include_usage":true}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `"prompt_tokens_details":{"cached_tokens":4992}`) {
		t.Fatalf("the usage does not report the cached prefix (4,992 tokens: 39 whole 512-byte blocks of the 20,000-byte prompt): %s", b)
	}
}

// With a batch slowdown, concurrency raises per-user latency: 8 at once
// make a prefill up to 9x slower (BatchSlowdown 1). A busy machine only
// adds to each measure: the request alone is the fastest of five.
func TestBatchSlowdown(t *testing.T) {
	s := httptest.NewServer(New(Options{PrefillBase: 20 * time.Millisecond, TokenGap: 5 * time.Millisecond, BatchSlowdown: 1, MaxTokens: 2}))
	defer s.Close()
	alone := time.Hour
	for range 5 {
		alone = min(alone, ttft(t, s.URL, `{"stream":true}`))
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var worst time.Duration
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := ttft(t, s.URL, `{"stream":true}`)
			mu.Lock()
			worst = max(worst, d)
			mu.Unlock()
		}()
	}
	wg.Wait()
	if worst < 2*alone {
		t.Fatalf("8 concurrent: worst TTFT %v, alone %v: no batching effect", worst, alone)
	}
}

// A /_mock/PREFILL/GAP/ path sets one request's timing: the prefill and
// the gap between its tokens, over the server's; a malformed one is a 400.
func TestPathTiming(t *testing.T) {
	s := httptest.NewServer(New(Options{PrefillBase: time.Millisecond, TokenGap: time.Millisecond, Jitter: 0.01, MaxTokens: 3}))
	defer s.Close()
	if d := ttft(t, s.URL+"/_mock/80ms/0s", `{"stream":true}`); d < 80*time.Millisecond {
		t.Errorf("first byte after %v, want the path's 80 ms prefill", d)
	}
	start := time.Now()
	resp, err := http.Post(s.URL+"/_mock/0s/40ms/v1/chat/completions", "application/json", strings.NewReader(`{"max_tokens":3}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if d := time.Since(start); resp.StatusCode != 200 || d < 78*time.Millisecond || !strings.Contains(string(body), "chat.completion") {
		t.Errorf("three tokens 40 ms apart: %d after %v: %s", resp.StatusCode, d, body)
	}
	for _, p := range []string{"/_mock/80ms/v1/chat/completions", "/_mock/x/0s/v1/chat/completions", "/_mock/-1s/0s/v1/chat/completions"} {
		resp, err := http.Post(s.URL+p, "application/json", strings.NewReader(`{}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 400 {
			t.Errorf("%s: %d, want 400", p, resp.StatusCode)
		}
	}
}

// With Slots, at most that many requests are served at once: the others
// wait in arrival order, their wait part of their TTFT; SetSlowdown
// stretches every step.
func TestSlotsQueueAndSlowdown(t *testing.T) {
	srv := New(Options{PrefillBase: 40 * time.Millisecond, TokenGap: 20 * time.Millisecond, Jitter: 0.01, MaxTokens: 4, Slots: 2})
	s := httptest.NewServer(srv)
	defer s.Close()
	var wg sync.WaitGroup
	got := make([]time.Duration, 4)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * 5 * time.Millisecond) // in order
			got[i] = ttft(t, s.URL, `{"stream":true}`)
		}()
	}
	wg.Wait()
	// The first two start at once; the last two wait for a whole request
	// (40 ms + 3 gaps of 20 ms) before their own prefill.
	if got[0] > 90*time.Millisecond || got[3] < 120*time.Millisecond {
		t.Fatalf("TTFTs %v: want the first ~40 ms and the last two after a slot freed (>= 140 ms)", got)
	}
	srv.SetSlowdown(3)
	if d := ttft(t, s.URL, `{"stream":true}`); d < 110*time.Millisecond {
		t.Fatalf("slowed 3x: TTFT %v, want >= 120 ms", d)
	}
}
