package proxy

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// cachedBackend is a simulated server whose prefix cache holds 4 prompts,
// a prompt's uncached tokens costing 1 µs each of prefill.
var cachedBackend = mockllm.Options{PrefixCache: true, PrefixCachePrompts: 4, PrefillBase: 200 * time.Microsecond,
	PrefillPerToken: time.Microsecond, TokenGap: 50 * time.Microsecond, MaxTokens: 4}

// systemPrompts are 16 system prompts of about 3 KB, each its own from its
// first bytes.
func systemPrompts() []string {
	out := make([]string, 16)
	for i := range out {
		out[i] = fmt.Sprintf("You are assistant number %d. ", i) + strings.Repeat(fmt.Sprintf("Rule %d: answer briefly. ", i), 120)
	}
	return out
}

// affinityRun sends n requests (workers at a time) through a route of four
// cached backends balanced by balance and sticky, each with one of 16
// system prompts (the first at 30%, the others alike) and a question of
// its own, and returns the share of cache hits the records say and each
// upstream's requests.
func affinityRun(t *testing.T, balance, sticky string, n, workers int) (hits float64, by map[string]int) {
	t.Helper()
	var ups []Upstream
	for i := range 4 {
		srv := httptest.NewServer(mockllm.New(cachedBackend))
		t.Cleanup(srv.CloseClientConnections)
		t.Cleanup(srv.Close)
		ups = append(ups, Upstream{Name: fmt.Sprintf("u%d", i), URL: srv.URL, Weight: 1})
	}
	tp := startProxyRecords(t, "", func(c *Config) {
		c.Routes = []Route{{Name: "chat", Prefix: "/", Timeouts: DefaultTimeouts, Upstreams: ups, Balance: balance, Sticky: sticky}}
	}, Options{}, n+10)
	prompts := systemPrompts()
	rng := rand.New(rand.NewPCG(5, 5))
	bodies := make([]string, n)
	for i := range bodies {
		p := 0
		if rng.Float64() >= 0.3 {
			p = 1 + rng.IntN(15)
		}
		bodies[i] = fmt.Sprintf(`{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"system","content":%q},{"role":"user","content":"question %d"}]}`, prompts[p], i)
	}
	work := make(chan string)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for b := range work {
				resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(b))
				if err != nil {
					t.Error(err)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	for _, b := range bodies {
		work <- b
	}
	close(work)
	wg.Wait()
	by = map[string]int{}
	hit, reported := 0, 0
	for range n {
		r := tp.rec.next(t)
		by[r.Upstream]++
		if r.CachedTokens >= 0 {
			reported++
			if r.CachedTokens > 0 {
				hit++
			}
		}
	}
	if reported < n*9/10 {
		t.Fatalf("only %d of %d records say their cached tokens", reported, n)
	}
	// /stats says the same as the records.
	var shown int64
	for _, o := range tp.p.Overload() {
		shown += int64(o.CacheHitShare*float64(o.CacheReported) + 0.5)
	}
	if sticky == StickyPrefix && shown != int64(hit) {
		t.Errorf("the overload table counts %d cache hits, the records %d", shown, hit)
	}
	return float64(hit) / float64(reported), by
}

// TestStickyPrefixKeepsCachesWarm: four upstreams whose prefix caches
// hold 4 prompts each, 16 system prompts (one hot at 30%). Sent by fewest
// in flight (8 at a time), a prompt lands anywhere and the caches thrash;
// sent by its prefix (sticky: prefix) one at a time, at least 85% of
// requests hit their upstream's cache: with one request in flight every
// upstream is within its bound, and the hot prompt stays on its home
// however many of it come (it was spread over all four before, each
// spill a miss), so that run's choices depend on the order of requests
// alone and its figure is the same on any machine. Eight at a time, these
// backends' first tokens come no later with more in flight (no batch to
// fill): a request waits for none where its prompt is cached, and the hot
// prompt stays there too; 65% hit (73-84% in 12 runs under the race
// detector on this 2-core machine, 74.x% once in CI, where 75% was the
// bound; fewest in flight alone gets 38-41%). The load bound that
// spreads a key from a busy upstream is TestRingBoundsLoad's.
func TestStickyPrefixKeepsCachesWarm(t *testing.T) {
	wait.Long(t, "3,600 requests to four cached backends")
	const n = 1200
	var base, aff, aff8 float64
	var baseBy, affBy, aff8By map[string]int
	var wg sync.WaitGroup
	wg.Go(func() { base, baseBy = affinityRun(t, BalanceLeastInflight, "", n, 8) })
	wg.Go(func() { aff, affBy = affinityRun(t, BalanceLeastInflight, StickyPrefix, n, 1) })
	wg.Go(func() { aff8, aff8By = affinityRun(t, BalanceLeastInflight, StickyPrefix, n, 8) })
	wg.Wait()
	t.Logf("least_inflight: %.0f%% cache hits, split %v; sticky prefix: %.0f%% hits, split %v; 8 at a time %.0f%%, split %v",
		100*base, baseBy, 100*aff, affBy, 100*aff8, aff8By)
	if aff < 0.85 {
		t.Errorf("sticky prefix: %.0f%% cache hits, want at least 85%%", 100*aff)
	}
	if aff <= base || aff8 <= base || aff8 < 0.65 {
		t.Errorf("sticky prefix: %.0f%% cache hits, 8 at a time %.0f%%; least_inflight's %.0f%%", 100*aff, 100*aff8, 100*base)
	}
}
