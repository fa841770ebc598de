package proxy

import (
	"bytes"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
)

// The price fixtures: what a backend answers, by the X-Fixture header.
var priceFixtures = map[string]struct{ contentType, body string }{
	"openai-json": {"application/json", `{"id":"c1","object":"chat.completion","model":"gpt-4o-2024-08-06","choices":[{"index":0,"message":{"role":"assistant","content":"` + words300 + `"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":2000,"completion_tokens":300,"total_tokens":2300,"prompt_tokens_details":{"cached_tokens":1500}}}`},
	"openai-json-nomodel": {"application/json", `{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"` + words300 + `"},"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":2000,"completion_tokens":300,"total_tokens":2300}}`},
	"openai-stream": {"text/event-stream", chatChunk("a") + chatChunk("b") + chatChunk("c") +
		`data: {"choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":3,"total_tokens":1003,"prompt_tokens_details":{"cached_tokens":0}}}` + "\n\ndata: [DONE]\n\n"},
	"openai-stream-nousage": {"text/event-stream", chatChunk("a") + chatChunk("b") + chatChunk("c") + chatChunk("d") + "data: [DONE]\n\n"},
	"anthropic-stream": {"text/event-stream", "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":100,\"cache_creation_input_tokens\":2000,\"cache_read_input_tokens\":5000,\"output_tokens\":1}}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":50}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"},
}

// words300 is the text of 300 output tokens: a usage that claims more
// tokens than a response's bytes carry is set aside.
var words300 = strings.Repeat(" tok", 300)

var testPrices = []Price{
	{Model: "gpt-4o*", Input: 2.50, CachedInput: 1.25, CacheWrite: -1, Output: 10},
	{Model: "claude-sonnet-4*", Input: 3, CachedInput: 0.30, CacheWrite: 3.75, Output: 15},
	{Model: "*-mini", Input: 0.15, CachedInput: -1, CacheWrite: -1, Output: 0.60},
}

// TestCostOfEachRecord: fixtures in the OpenAI (whole and streamed) and
// Anthropic dialects with cache reads and writes, through tokentap with
// prices. Each record's cached and cache-write tokens, usage source and
// cost are exact; a stream without usage is counted and priced above $0;
// a request is priced as the model the response names; a model with no
// price, served by a response that names none, has no cost; tokentap_cost_usd_total per tenant is the
// sum of its records'.
func TestCostOfEachRecord(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		f := priceFixtures[r.Header.Get("X-Fixture")]
		w.Header().Set("Content-Type", f.contentType)
		io.WriteString(w, f.body)
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Prices = testPrices
		c.Models = []string{"gpt-4o", "claude-sonnet-4-5", "llama-x"}
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "costa", Keys: []string{"ka"}, Limits: Limits1000()},
			ratelimit.Tenant{Name: "costb", Keys: []string{"kb"}, Limits: Limits1000()})(c)
	})
	send := func(key, fixture, path, body string) metrics.Record {
		t.Helper()
		req := mustReq(t, "POST", tp.url+path, body)
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("X-Fixture", fixture)
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return tp.rec.next(t)
	}
	costOf := func(tenant string) float64 {
		return promFloat(t, costSeries("gpt-4o", tenant)) + promFloat(t, costSeries("claude-sonnet-4-5", tenant)) + promFloat(t, costSeries("llama-x", tenant))
	}
	costBefore := map[string]float64{"costa": costOf("costa"), "costb": costOf("costb")}
	nousage := `{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 400) + `"}]}`
	cases := []struct {
		key, fixture, path, body string
		cached, written          int
		source                   string
		cost                     float64 // −1: none
	}{
		{"ka", "openai-json", "/v1/chat/completions", `{"model":"gpt-4o","messages":[]}`, 1500, 0, metrics.UsageProvider, (500*2.5 + 1500*1.25 + 300*10) / 1e6},
		{"kb", "openai-stream", "/v1/chat/completions", `{"model":"gpt-4o","stream":true,"messages":[]}`, 0, 0, metrics.UsageProvider, (1000*2.5 + 3*10) / 1e6},
		{"ka", "anthropic-stream", "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true,"messages":[]}`, 5000, 2000, metrics.UsageProvider,
			(100*3 + 5000*0.30 + 2000*3.75 + 50*15) / 1e6},
		{"kb", "openai-stream-nousage", "/v1/chat/completions", nousage, -1, 0, metrics.UsageCounted, (float64(len(nousage)/4)*2.5 + 4*10) / 1e6},
		// Priced as the model that served it.
		{"ka", "openai-json", "/v1/chat/completions", `{"model":"llama-x","messages":[]}`, 1500, 0, metrics.UsageProvider, (500*2.5 + 1500*1.25 + 300*10) / 1e6},
		{"ka", "openai-json-nomodel", "/v1/chat/completions", `{"model":"llama-x","messages":[]}`, -1, 0, metrics.UsageProvider, -1},
	}
	sum := map[string]float64{}
	for _, c := range cases {
		rec := send(c.key, c.fixture, c.path, c.body)
		if rec.CachedTokens != c.cached || rec.CacheWriteTokens != c.written || rec.UsageSource != c.source {
			t.Errorf("%s: cached %d, cache write %d, source %q; want %d, %d, %q", c.fixture, rec.CachedTokens, rec.CacheWriteTokens, rec.UsageSource, c.cached, c.written, c.source)
		}
		if math.Abs(rec.Cost.USD-c.cost) > 1e-12 {
			t.Errorf("%s (%s): cost %.9f, want %.9f", c.fixture, c.body[:20], rec.Cost.USD, c.cost)
		}
		if c.source == metrics.UsageCounted && rec.Cost.USD <= 0 {
			t.Errorf("a stream without usage priced at %v", rec.Cost.USD)
		}
		if want := map[bool]string{true: metrics.CostModel, false: metrics.CostUnpriced}[c.cost >= 0]; rec.Cost.Basis != want {
			t.Errorf("%s: cost basis %q, want %q", c.fixture, rec.Cost.Basis, want)
		}
		if rec.Cost.USD > 0 {
			sum[rec.Tenant] += rec.Cost.USD
		}
	}
	if rec := send("ka", "anthropic-stream", "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true}`); rec.InputTokens != 7100 {
		t.Errorf("Anthropic input tokens %d, want the whole prompt (100 + 2000 + 5000)", rec.InputTokens)
	} else {
		sum[rec.Tenant] += rec.Cost.USD
	}
	for tenant, want := range sum {
		got := costOf(tenant) - costBefore[tenant]
		if math.Abs(got-want) > 1e-9 {
			t.Errorf("tokentap_cost_usd_total for %s: %.9f, the records sum to %.9f", tenant, got, want)
		}
	}
}

func costSeries(model, tenant string) string {
	return `tokentap_cost_usd_total{route="default",model="` + model + `",tenant="` + tenant + `"}`
}

// promFloat reads one series' value from the process's metrics (0: none).
func promFloat(t *testing.T, series string) float64 {
	t.Helper()
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, line := range strings.Split(b.String(), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// TestPricesRefused: a price without a model, or a negative one, is
// refused with its field named.
func TestPricesRefused(t *testing.T) {
	for _, c := range []struct {
		p    Price
		want string
	}{
		{Price{Input: 1, Output: 1, CachedInput: -1, CacheWrite: -1}, "prices[0].model"},
		{Price{Model: "x", Input: -2, Output: 1, CachedInput: -1, CacheWrite: -1}, "prices[0].input"},
		{Price{Model: "x", Input: 1, Output: 1, CachedInput: -3, CacheWrite: -1}, "prices[0].cached_input"},
		{Price{Model: "x", Input: 1, Output: math.NaN(), CachedInput: -1, CacheWrite: -1}, "prices[0].output"},
	} {
		cfg := Config{Routes: []Route{{Name: "r", Prefix: "/", Upstream: "http://127.0.0.1:1", Timeouts: DefaultTimeouts}}, Prices: []Price{c.p}}
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error naming %s", c.p, err, c.want)
		}
	}
}

// TestDollarBudget: a tenant with $0.012 a day, each request reserved and
// costing $0.00375 (1,000 output tokens at $3.75 a million): three get
// through, then a 429 that names the day's dollar budget, with Retry-After
// until the UTC day ends.
func TestDollarBudget(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		// A thousand tokens' text: usage past what the bytes carry is set aside.
		io.WriteString(w, `{"choices":[{"message":{"content":"`+strings.Repeat("word ", 200)+`"}}],"usage":{"prompt_tokens":10,"completion_tokens":1000}}`)
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Prices = []Price{{Model: "dollar-*", Input: 0, CachedInput: -1, CacheWrite: -1, Output: 3.75}}
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "spender", Keys: []string{"ks"}, Limits: ratelimit.Limits{USDPerDay: 0.012}})(c)
	})
	body := `{"model":"dollar-model","max_tokens":1000,"messages":[]}`
	var statuses []int
	var refused []byte
	var retry string
	for range 5 {
		resp, b := postKey(t, tp.url+"/v1/chat/completions", "ks", body)
		statuses = append(statuses, resp.StatusCode)
		if resp.StatusCode == 429 && refused == nil {
			refused, retry = b, resp.Header.Get("Retry-After")
		}
		rec := tp.rec.next(t)
		if resp.StatusCode == 200 && math.Abs(rec.Cost.USD-0.00375) > 1e-12 {
			t.Errorf("a request's cost %v, want 0.00375", rec.Cost.USD)
		}
	}
	if !slicesEqual(statuses, []int{200, 200, 200, 429, 429}) {
		t.Fatalf("statuses %v, want three through, then 429", statuses)
	}
	secs, _ := strconv.Atoi(retry)
	if !strings.Contains(string(refused), "usd_per_day") || secs < 1 || secs > 86400 {
		t.Errorf("the refusal %s, Retry-After %q: want it to name usd_per_day and when the day ends", refused, retry)
	}
}

func slicesEqual(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
