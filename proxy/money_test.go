package proxy

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
)

// TestDuplicateModelRefused: a body that names "model" (or "stream") twice
// is refused with a 400 in its dialect's shape and reaches no backend, on
// a route by model and on a plain one: tokentap would read the first, the
// backend the last.
func TestDuplicateModelRefused(t *testing.T) {
	cheap, dear := startDeployment(t, "cheap"), startDeployment(t, "dear")
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{
			{Name: "cheap", Prefix: "/v1/", Models: []string{"cheap"}, Upstream: cheap.url, Timeouts: DefaultTimeouts},
			{Name: "dear", Prefix: "/v1/", Models: []string{"gpt-4o"}, Upstream: dear.url, Timeouts: DefaultTimeouts},
			{Name: "plain", Prefix: "/plain/", Upstream: cheap.url, Timeouts: DefaultTimeouts},
		}
	})
	for _, c := range []struct{ path, body, anthropic string }{
		{"/v1/chat/completions", `{"model":"cheap","model":"gpt-4o","messages":[]}`, ""},
		{"/v1/chat/completions", `{"model":"cheap","messages":[],"m\u006fdel":"gpt-4o"}`, ""},
		{"/v1/messages", `{"model":"cheap","max_tokens":5,"model":"gpt-4o"}`, "yes"},
		{"/plain/v1/chat/completions", `{"model":"cheap","stream":false,"stream":true}`, ""},
	} {
		status, body := ask(t, tp.url, c.path, c.body)
		var e struct {
			Type  string
			Error struct{ Type, Code, Message string }
		}
		_ = json.Unmarshal([]byte(body), &e)
		if status != 400 || e.Error.Type != "invalid_request_error" || !strings.Contains(e.Error.Message, "more than once") {
			t.Errorf("%s %s: %d %s, want a 400 invalid_request_error", c.path, c.body, status, body)
		}
		if (c.anthropic != "") != (e.Type == "error") || (c.anthropic == "") != (e.Error.Code == "duplicate_member") {
			t.Errorf("%s: body %s is not in the dialect's shape", c.path, body)
		}
		if rec := tp.rec.next(t); rec.Status != 400 || rec.Attempts != 0 {
			t.Errorf("%s: record status %d, attempts %d", c.path, rec.Status, rec.Attempts)
		}
	}
	if n := cheap.hits.Load() + dear.hits.Load(); n != 0 {
		t.Errorf("%d requests reached a backend", n)
	}
	if status, _ := ask(t, tp.url, "/v1/chat/completions", `{"model":"gpt-4o","messages":[{"model":"cheap"}]}`); status != 200 || dear.hits.Load() != 1 {
		t.Errorf("a nested model member: %d, dear hits %d; want served by dear", status, dear.hits.Load())
	}
}

// TestBudgetNotDodgedByAnUnreadableBody: a catch-all price ("*") and a
// day's budget of $0.012, each request costing $0.00375 (1,000 output
// tokens at $3.75 a million; the backend answers whatever the body says and
// names no model). A body with no model, a model that is a number, a body
// that is not JSON and one gzip-encoded are each priced by the catch-all:
// three through, then 429, as for a body that names its model. Before, all
// were served free.
func TestBudgetNotDodgedByAnUnreadableBody(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		// A thousand tokens' text: usage past what the bytes carry is set aside.
		io.WriteString(w, `{"choices":[{"message":{"content":"`+strings.Repeat("word ", 200)+`"}}],"usage":{"prompt_tokens":10,"completion_tokens":1000}}`)
	})
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(`{"model":"free","messages":[]}`))
	zw.Close()
	bodies := map[string]string{"named": `{"model":"m","messages":[]}`, "nomodel": `{"messages":[]}`, "number": `{"model":7,"messages":[]}`,
		"notjson": `model=free`, "gzip": gz.String()}
	var tenants []ratelimit.Tenant
	for name := range bodies {
		tenants = append(tenants, ratelimit.Tenant{Name: name, Keys: []string{"k-" + name}, Limits: ratelimit.Limits{USDPerDay: 0.012}})
	}
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Prices = []Price{{Model: "*", Input: 0, CachedInput: -1, CacheWrite: -1, Output: 3.75}}
		withTenants(ratelimit.ModeReject, tenants...)(c)
	})
	for name, body := range bodies {
		var statuses []int
		for range 5 {
			req := mustReq(t, "POST", tp.url+"/v1/chat/completions", body)
			req.Header.Set("Authorization", "Bearer k-"+name)
			if name == "gzip" {
				req.Header.Set("Content-Encoding", "gzip")
			}
			resp, err := http.DefaultTransport.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses = append(statuses, resp.StatusCode)
			rec := tp.rec.next(t)
			if resp.StatusCode == 200 && (math.Abs(rec.Cost.USD-0.00375) > 1e-12 || rec.Cost.Basis != metrics.CostModel) {
				t.Errorf("%s: cost %v (%s), want 0.00375 at the catch-all", name, rec.Cost.USD, rec.Cost.Basis)
			}
		}
		if !slicesEqual(statuses, []int{200, 200, 200, 429, 429}) {
			t.Errorf("%s: statuses %v, want three through, then 429", name, statuses)
		}
	}
}

// TestUnpricedModelChargedAtTheRouteDearest: prices for two models and no
// catch-all. A request for a model with no price, from a tenant with a
// dollar budget, is charged at the dearest price that could apply (the
// reservation and the cost: route_max), and its budget runs out; from a
// tenant without one it is recorded unpriced, counted as such.
func TestUnpricedModelChargedAtTheRouteDearest(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":400,"completion_tokens":100}}`)
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Routes[0].Name = "unpriced"
		c.Prices = []Price{{Model: "gpt-4o*", Input: 2.5, CachedInput: -1, CacheWrite: -1, Output: 10}, {Model: "*-mini", Input: 0.15, CachedInput: -1, CacheWrite: -1, Output: 0.6}}
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "budget", Keys: []string{"kb"}, Limits: ratelimit.Limits{USDPerDay: 0.005}},
			ratelimit.Tenant{Name: "free", Keys: []string{"kf"}, Limits: Limits1000()})(c)
	})
	const dear = (400*2.5 + 100*10) / 1e6 // 0.002 a request
	unpricedBefore := promFloat(t, `tokentap_unpriced_requests_total{route="unpriced",charged="no"}`)
	chargedBefore := promFloat(t, `tokentap_unpriced_requests_total{route="unpriced",charged="route_max"}`)
	body := `{"model":"mystery","max_tokens":100,"messages":[]}`
	var statuses []int
	for range 4 {
		resp, _ := postKey(t, tp.url+"/v1/chat/completions", "kb", body)
		statuses = append(statuses, resp.StatusCode)
		rec := tp.rec.next(t)
		if resp.StatusCode == 200 && (math.Abs(rec.Cost.USD-dear) > 1e-12 || rec.Cost.Basis != metrics.CostDearest) {
			t.Errorf("budget tenant: cost %v (%q), want %v at route_max", rec.Cost.USD, rec.Cost.Basis, dear)
		}
	}
	if !slicesEqual(statuses, []int{200, 200, 429, 429}) {
		t.Errorf("statuses %v, want two through at the dearest price, then 429", statuses)
	}
	resp, _ := postKey(t, tp.url+"/v1/chat/completions", "kf", body)
	if rec := tp.rec.next(t); resp.StatusCode != 200 || rec.Cost.USD != -1 || rec.Cost.Basis != metrics.CostUnpriced {
		t.Errorf("tenant without a budget: %d, cost %v (%q), want unpriced", resp.StatusCode, rec.Cost.USD, rec.Cost.Basis)
	}
	if d := promFloat(t, `tokentap_unpriced_requests_total{route="unpriced",charged="no"}`) - unpricedBefore; d != 1 {
		t.Errorf("unpriced requests counted %v, want 1", d)
	}
	if d := promFloat(t, `tokentap_unpriced_requests_total{route="unpriced",charged="route_max"}`) - chargedBefore; d != 2 {
		t.Errorf("requests charged at the route's dearest counted %v, want 2", d)
	}
}

// TestHostileUsageSetAside: a stream of three tokens whose usage claims
// what cannot be true (1e30, NaN, Infinity, negative, fractional, a
// string, 1e9 tokens in a response of a few hundred bytes, more cached
// tokens than input) is set aside: the record says usage_source
// "rejected" and carries the three counted tokens, the cost is what the
// counted tokens and estimated input cost, the metric counts each, and a
// tenant's dollar budget moves by that cost only (1e9 used to lock it out
// for the day). An honest usage is kept.
func TestHostileUsageSetAside(t *testing.T) {
	var claim atomic.Value
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a")+chatChunk("b")+chatChunk("c")+`data: {"choices":[],"usage":`+claim.Load().(string)+"}\n\ndata: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Routes[0].Name = "hostile"
		c.Prices = []Price{{Model: "*", Input: 1, CachedInput: -1, CacheWrite: -1, Output: 10}}
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "payer", Keys: []string{"kp"}, Limits: ratelimit.Limits{USDPerDay: 0.001}})(c)
	})
	body := `{"model":"m","stream":true,"max_tokens":3,"messages":[]}`
	counted := (float64(len(body)/4)*1 + 3*10) / 1e6
	rejectedBefore := promFloat(t, `tokentap_usage_rejected_total{route="hostile"}`)
	costBefore := promFloat(t, `tokentap_cost_usd_total{route="hostile",model="m",tenant="payer"}`)
	hostile := []string{
		`{"prompt_tokens":1e30,"completion_tokens":1e30}`,
		`{"prompt_tokens":NaN,"completion_tokens":3}`,
		`{"prompt_tokens":5,"completion_tokens":Infinity}`,
		`{"prompt_tokens":-7,"completion_tokens":3}`,
		`{"prompt_tokens":5,"completion_tokens":2.5}`,
		`{"prompt_tokens":"5","completion_tokens":3}`,
		`{"prompt_tokens":5,"completion_tokens":1000000000}`,
		`{"prompt_tokens":5,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":900}}`,
		`{"prompt_tokens":1000000000,"completion_tokens":3}`,
	}
	var spent float64
	for _, u := range hostile {
		claim.Store(u)
		resp, b := postKey(t, tp.url+"/v1/chat/completions", "kp", body)
		rec := tp.rec.next(t)
		if resp.StatusCode != 200 || !strings.Contains(string(b), `"c"`) {
			t.Fatalf("%s: %d, the stream did not pass whole", u, resp.StatusCode)
		}
		if rec.UsageSource != metrics.UsageRejected || rec.OutputTokens != 3 || rec.InputTokens != 0 || rec.CachedTokens != -1 {
			t.Errorf("%s: usage_source %q, output %d, input %d, cached %d; want rejected, the 3 counted", u, rec.UsageSource, rec.OutputTokens, rec.InputTokens, rec.CachedTokens)
		}
		if math.Abs(rec.Cost.USD-counted) > 1e-12 {
			t.Errorf("%s: cost %v, want the counted %v", u, rec.Cost.USD, counted)
		}
		spent += rec.Cost.USD
	}
	if d := promFloat(t, `tokentap_usage_rejected_total{route="hostile"}`) - rejectedBefore; d != float64(len(hostile)) {
		t.Errorf("tokentap_usage_rejected_total moved by %v, want %d", d, len(hostile))
	}
	if d := promFloat(t, `tokentap_cost_usd_total{route="hostile",model="m",tenant="payer"}`) - costBefore; math.Abs(d-spent) > 1e-12 {
		t.Errorf("tokentap_cost_usd_total moved by %v, the records by %v", d, spent)
	}
	// The budget ($0.001) holds 22 requests' counted cost: the claims
	// spent none of it beyond that, so the tenant is still served.
	claim.Store(`{"prompt_tokens":12,"completion_tokens":3}`)
	resp, _ := postKey(t, tp.url+"/v1/chat/completions", "kp", body)
	if rec := tp.rec.next(t); resp.StatusCode != 200 || rec.UsageSource != metrics.UsageProvider || rec.InputTokens != 12 {
		t.Errorf("an honest request after the claims: %d, usage_source %q, input %d; want served, the provider's", resp.StatusCode, rec.UsageSource, rec.InputTokens)
	}
}

// TestHonestUsageKept: a usage within what the request's and the
// response's bytes and time could carry is the record's, provider.
func TestHonestUsageKept(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a")+chatChunk("b")+chatChunk("c")+
			`data: {"choices":[],"usage":{"prompt_tokens":40000,"completion_tokens":60,"completion_tokens_details":{"reasoning_tokens":57},"prompt_tokens_details":{"cached_tokens":30000}}}`+"\n\ndata: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	ask(t, tp.url, "/v1/chat/completions", `{"model":"m","stream":true,"messages":[]}`)
	if rec := tp.rec.next(t); rec.UsageSource != metrics.UsageProvider || rec.InputTokens != 40000 || rec.OutputTokens != 60 || rec.CachedTokens != 30000 {
		t.Errorf("usage_source %q, input %d, output %d, cached %d: want the provider's (input referenced beyond the body, hidden reasoning)",
			rec.UsageSource, rec.InputTokens, rec.OutputTokens, rec.CachedTokens)
	}
}
