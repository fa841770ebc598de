package proxy

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/ratelimit/redistest"
)

func withTenants(mode ratelimit.Mode, tenants ...ratelimit.Tenant) func(*Config) {
	return func(c *Config) {
		c.Admission = &ratelimit.Config{Tenants: tenants, Mode: mode, MaxQueue: 10, MaxWait: time.Second, Store: testStore}
	}
}

// testStore, when set, puts the admission tests' counts in a shared store
// (TestAdmissionWithSharedStore).
var testStore *ratelimit.StoreConfig

// The admission tests that read no limiter level from the response
// headers (a store sends none) run again with the counts in a real Redis:
// a store changes where the counts live, not what the limits mean.
func TestAdmissionWithSharedStore(t *testing.T) {
	r := redistest.Start(t)
	c := r.Client()
	scripts := func() int64 { // scripts the store ran
		info := c.Info(context.Background(), "commandstats").Val()
		var n int64
		for _, l := range strings.Split(info, "\n") {
			if strings.HasPrefix(l, "cmdstat_evalsha:") || strings.HasPrefix(l, "cmdstat_eval:") {
				v, _, _ := strings.Cut(strings.TrimPrefix(l[strings.Index(l, ":")+1:], "calls="), ",")
				k, _ := strconv.ParseInt(v, 10, 64)
				n += k
			}
		}
		return n
	}
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"TenantsFromKeys", TestTenantsFromKeys},
		{"UnknownKeyToDefaultTenantAndTrustedHeader", TestUnknownKeyToDefaultTenantAndTrustedHeader},
		{"CancelWhileQueuedAndGaugesReturnToZero", TestCancelWhileQueuedAndGaugesReturnToZero},
		{"QueueTimeMeasured", TestQueueTimeMeasured},
	} {
		testStore = &ratelimit.StoreConfig{Redis: ratelimit.RedisConfig{Addr: r.Addr, Timeout: time.Second, KeyPrefix: tc.name + ":"}}
		before := scripts()
		t.Run(tc.name, tc.f)
		testStore = nil
		if n := scripts() - before; n < 2 {
			t.Errorf("%s ran %d scripts in Redis: its admission did not use the store", tc.name, n)
		}
	}
}

func postKey(t *testing.T, url, key, body string) (*http.Response, []byte) {
	t.Helper()
	req := mustReq(t, "POST", url, body)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	return resp, b
}

func TestTenantsFromKeys(t *testing.T) {
	// Series live for the process: count what this test adds.
	okBefore := promValue(t, `tokentap_tenant_requests_total{tenant="alpha",outcome="ok"}`)
	var seenTenant atomic.Value
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		seenTenant.Store(r.Header.Get("X-Tokentap-Tenant"))
		io.WriteString(w, `{"usage":{"prompt_tokens":1,"completion_tokens":1}}`)
	})
	tp := startProxy(t, up.URL, withTenants(ratelimit.ModeReject,
		ratelimit.Tenant{Name: "alpha", Keys: []string{"sk-alpha-secret"}, Limits: Limits1000()}))

	resp, body := postKey(t, tp.url+"/v1/chat/completions", "sk-wrong", `{}`)
	if resp.StatusCode != 401 || !strings.Contains(string(body), "invalid_api_key") {
		t.Fatalf("unknown key: %d %s", resp.StatusCode, body)
	}
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeLimited || rec.Status != 401 || rec.UpstreamTTFB != metrics.Absent || rec.Tenant != "unknown" {
		t.Fatalf("record: %+v", rec)
	}
	// A client cannot claim a tenant with tokentap's own header.
	req := mustReq(t, "POST", tp.url+"/v1/chat/completions", `{}`)
	req.Header.Set("X-Api-Key", "sk-alpha-secret")
	req.Header.Set("X-Tokentap-Tenant", "root")
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || seenTenant.Load() != "alpha" {
		t.Fatalf("x-api-key: %d, upstream saw tenant %v", resp.StatusCode, seenTenant.Load())
	}
	if rec := tp.rec.next(t); rec.Tenant != "alpha" || rec.Outcome != metrics.OutcomeOK {
		t.Fatalf("record: %+v", rec)
	}
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	if strings.Contains(b.String(), "sk-alpha-secret") || promValue(t, `tokentap_tenant_requests_total{tenant="alpha",outcome="ok"}`)-okBefore != 1 {
		t.Fatalf("tenant metrics wrong or hold the key")
	}
}

func Limits1000() ratelimit.Limits { return ratelimit.Limits{RequestsPerSecond: 1000, Burst: 1000} }

func TestUnknownKeyToDefaultTenantAndTrustedHeader(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	tp := startProxy(t, up.URL, func(c *Config) {
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "alpha", Keys: []string{"k"}}, ratelimit.Tenant{Name: "guest"})(c)
		c.Admission.UnknownKey = "guest"
	})
	postKey(t, tp.url+"/x", "", `{}`)
	if rec := tp.rec.next(t); rec.Tenant != "guest" || rec.Status != 200 {
		t.Fatalf("record: %+v", rec)
	}

	tp2 := startProxy(t, up.URL, func(c *Config) {
		withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "alpha", Keys: []string{"k"}}, ratelimit.Tenant{Name: "beta"})(c)
		c.Admission.TrustedTenantHeader = "X-Tenant"
	})
	req := mustReq(t, "POST", tp2.url+"/x", `{}`)
	req.Header.Set("X-Tenant", "beta")
	req.Header.Set("Authorization", "Bearer k") // ignored in trusted-header mode
	resp, _ := http.DefaultTransport.RoundTrip(req)
	resp.Body.Close()
	if rec := tp2.rec.next(t); rec.Tenant != "beta" || rec.Status != 200 {
		t.Fatalf("trusted header: %+v", rec)
	}
	resp, _ = postKey(t, tp2.url+"/x", "k", `{}`)
	if rec := tp2.rec.next(t); resp.StatusCode != 401 || rec.Outcome != metrics.OutcomeLimited {
		t.Fatalf("no trusted header: %d %+v", resp.StatusCode, rec)
	}
}

func TestRateLimited429WithHeaders(t *testing.T) {
	rejectedBefore := promValue(t, `tokentap_admission_rejected_total{tenant="a",reason="requests"}`)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	tp := startProxy(t, up.URL, withTenants(ratelimit.ModeReject,
		ratelimit.Tenant{Name: "a", Keys: []string{"k"}, Limits: ratelimit.Limits{RequestsPerSecond: 0.2, Burst: 2, TokensPerMinute: 100000}}))
	for i := 0; i < 2; i++ {
		resp, _ := postKey(t, tp.url+"/v1/chat/completions", "k", `{"max_tokens":100}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Ratelimit-Limit-Requests") != "2" ||
			resp.Header.Get("X-Ratelimit-Remaining-Requests") != strconv.Itoa(1-i) || resp.Header.Get("X-Ratelimit-Limit-Tokens") != "100000" {
			t.Fatalf("admitted %d: %d %v", i, resp.StatusCode, resp.Header)
		}
		tp.rec.next(t)
	}
	resp, body := postKey(t, tp.url+"/v1/chat/completions", "k", `{"max_tokens":100}`)
	if resp.StatusCode != 429 || !strings.Contains(string(body), "rate_limit_exceeded") {
		t.Fatalf("third: %d %s", resp.StatusCode, body)
	}
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 4 || ra > 5 {
		t.Fatalf("Retry-After %q, want 5 (one request per 5 s)", resp.Header.Get("Retry-After"))
	}
	if resp.Header.Get("X-Ratelimit-Remaining-Requests") != "0" || resp.Header.Get("X-Ratelimit-Reset-Requests") == "" {
		t.Fatalf("429 headers: %v", resp.Header)
	}
	rec := tp.rec.next(t)
	if rec.Outcome != metrics.OutcomeLimited || rec.Status != 429 || rec.Tenant != "a" || rec.UpstreamTTFB != metrics.Absent || rec.Queue < 0 {
		t.Fatalf("record: %+v", rec)
	}
	if promValue(t, `tokentap_admission_rejected_total{tenant="a",reason="requests"}`)-rejectedBefore != 1 {
		t.Fatal("rejection not counted")
	}
}

// The token budget is reserved before forwarding and reconciled with the
// real usage: streamed usage, a truncated stream (counted tokens) and a
// stream without usage.
func TestTokenBudgetReconciledFromTheStream(t *testing.T) {
	usageChunk := `data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2}}` + "\n\n"
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a")+chatChunk("b"))
		flush(w)
		switch r.URL.Query().Get("mode") {
		case "usage":
			io.WriteString(w, usageChunk+"data: [DONE]\n\n")
		case "truncated":
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		default:
			io.WriteString(w, "data: [DONE]\n\n")
		}
	})
	// A tenant a case: each budget starts full, with no wait for a refill.
	var tenants []ratelimit.Tenant
	for _, name := range []string{"usage", "none", "truncated"} {
		tenants = append(tenants, ratelimit.Tenant{Name: name, Keys: []string{"k-" + name}, Limits: ratelimit.Limits{TokensPerMinute: 60_000}})
	}
	tp := startProxy(t, up.URL, withTenants(ratelimit.ModeReject, tenants...))
	body := `{"stream":true,"max_tokens":1000,"x":"` + strings.Repeat("y", 380) + `"}` // ~100 tokens in, 1000 out
	remaining := func(resp *http.Response) int {
		n, _ := strconv.Atoi(resp.Header.Get("X-Ratelimit-Remaining-Tokens"))
		return n
	}
	check := func(mode string, used int) {
		t.Helper()
		path := "/v1/chat/completions?mode=" + mode
		resp, _ := postKey(t, tp.url+path, "k-"+mode, body)
		// During the request the whole estimate is reserved.
		if r := remaining(resp); r > 60_000-1100 || r < 60_000-1200 {
			t.Fatalf("%s: remaining while reserved %d", path, r)
		}
		rec := tp.rec.next(t)
		if rec.Tenant != mode {
			t.Fatalf("%s: %+v", path, rec)
		}
		// After it, only what was used is spent (the budget refills at
		// 1000/s, so allow the time the test took).
		_, tok := tp.p.snap.Load().admit.Quotas(mode, "default")
		if tok.Remaining < int64(60_000-used-5) || tok.Remaining > 60_000 {
			t.Fatalf("%s: remaining after %d, want ≈ %d", path, tok.Remaining, 60_000-used)
		}
	}
	check("usage", 42)        // 40 in + 2 out, from usage
	check("none", 105+2)      // estimated input (420 bytes / 4) + 2 counted
	check("truncated", 105+2) // truncated: estimated input + 2 counted
	for _, tn := range tenants {
		if in, q := tp.p.snap.Load().admit.Stats(tn.Name); in != 0 || q != 0 {
			t.Fatalf("%s: gauges after: in flight %d queued %d", tn.Name, in, q)
		}
	}
}

// A client that leaves while queued never reaches the upstream, and the
// gauges return to zero, cancelled streams included.
func TestCancelWhileQueuedAndGaugesReturnToZero(t *testing.T) {
	cancelledBefore := promValue(t, `tokentap_admission_rejected_total{tenant="a",reason="cancelled"}`)
	var upstreamCalls atomic.Int64
	release := make(chan struct{})
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		upstreamCalls.Add(1)
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("a"))
		flush(w)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		withTenants(ratelimit.ModeQueue, ratelimit.Tenant{Name: "a", Keys: []string{"k"}, Limits: ratelimit.Limits{MaxConcurrent: 1}})(c)
		c.Admission.MaxWait = 5 * time.Second
	})
	admit := tp.p.snap.Load().admit

	// The first request holds the only slot, streaming.
	c1, br1 := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`, "Authorization: Bearer k"))
	if _, err := http.ReadResponse(br1, nil); err != nil {
		t.Fatal(err)
	}
	// The second waits in the queue, then its client leaves.
	c2, _ := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"stream":true}`, "Authorization: Bearer k"))
	waitUntil(t, func() bool { _, q := admit.Stats("a"); return q == 1 })
	c2.Close()
	rec := tp.rec.next(t)
	if rec.Outcome != metrics.OutcomeClientCancel || rec.Status != 499 || rec.Queue <= 0 || rec.UpstreamTTFB != metrics.Absent {
		t.Fatalf("queued cancel: %+v", rec)
	}
	if in, q := admit.Stats("a"); in != 1 || q != 0 || upstreamCalls.Load() != 1 {
		t.Fatalf("after queued cancel: in flight %d queued %d upstream calls %d", in, q, upstreamCalls.Load())
	}
	// The streaming client leaves too: its slot is freed.
	c1.Close()
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeClientCancel {
		t.Fatalf("stream cancel: %+v", rec)
	}
	if in, q := admit.Stats("a"); in != 0 || q != 0 {
		t.Fatalf("gauges after traffic: in flight %d queued %d", in, q)
	}
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, want := range []string{`tokentap_tenant_inflight{tenant="a"} 0`, `tokentap_tenant_queue_depth{tenant="a"} 0`} {
		if !strings.Contains(b.String(), want) {
			t.Fatalf("/metrics lacks %s", want)
		}
	}
	if n := promValue(t, `tokentap_admission_rejected_total{tenant="a",reason="cancelled"}`) - cancelledBefore; n != 1 {
		t.Fatalf("cancelled while queued counted %d times, want 1", n)
	}
	close(release)
}

// Queued time shows in queue_ms; TTFT still counts from arrival.
func TestQueueTimeMeasured(t *testing.T) {
	release := make(chan struct{})
	var calls atomic.Int64
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		if calls.Add(1) == 1 {
			select { // the first holds the only slot until the test lets it go
			case <-release:
			case <-r.Context().Done():
			}
		}
		io.WriteString(w, chatChunk("a"))
	})
	tp := startProxy(t, up.URL, func(c *Config) {
		withTenants(ratelimit.ModeQueue, ratelimit.Tenant{Name: "a", Keys: []string{"k"}, Limits: ratelimit.Limits{MaxConcurrent: 1}})(c)
		c.Admission.MaxWait = time.Minute
	})
	admit := tp.p.snap.Load().admit
	countBefore := promValue(t, `tokentap_queue_seconds_count{route="default",model="other"}`)
	done := make(chan struct{}, 2)
	post := func() {
		postKey(t, tp.url+"/v1/chat/completions", "k", `{"stream":true}`)
		done <- struct{}{}
	}
	go post()
	waitUntil(t, func() bool { return calls.Load() == 1 })
	go post()
	waitUntil(t, func() bool { _, q := admit.Stats("a"); return q == 1 })
	// The second was queued before this sleep and is admitted only after
	// the first ends, which the test allows after it: a lower bound the
	// test controls, whatever the machine's load.
	const held = 50 * time.Millisecond
	time.Sleep(held)
	close(release)
	<-done
	<-done
	a, b := tp.rec.next(t), tp.rec.next(t)
	if a.Queue > b.Queue {
		a, b = b, a
	}
	if b.Queue < held || b.TTFT < b.Queue {
		t.Fatalf("queue %v / %v, second ttft %v: the second waited at least %v", a.Queue, b.Queue, b.TTFT, held)
	}
	if promValue(t, `tokentap_queue_seconds_count{route="default",model="other"}`)-countBefore != 2 {
		t.Fatal("queue histogram not updated")
	}
}

// seriesSum adds the values of the series of family whose labels hold
// every one of want (label="value" pairs), from the process's registry.
func seriesSum(family string, want ...string) float64 {
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	sum := 0.0
	for _, line := range strings.Split(b.String(), "\n") {
		name, rest, ok := strings.Cut(line, "{")
		if !ok || name != family {
			continue
		}
		labels, v, _ := strings.Cut(rest, "} ")
		match := true
		for _, w := range want {
			match = match && strings.Contains(labels, w)
		}
		if f, err := strconv.ParseFloat(v, 64); match && err == nil {
			sum += f
		}
	}
	return sum
}

// The rule: a refusal for the client's own doing (its tenant's 429s, an
// unknown key's 401) is counted apart and not judged; a failure of the
// service (an upstream's 502, tokentap unable to serve: 503) counts
// against goodput. A tenant sending past its rate took its route's
// goodput to 25–59% and paged while the backend was healthy; in records,
// /stats and the metrics the route now keeps goodput 100% until the
// service fails a request.
func TestOnlyServiceFailuresCountAgainstGoodput(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		if r.URL.Query().Get("fail") != "" {
			w.WriteHeader(502)
		}
		io.WriteString(w, "{}")
	})
	route := fmt.Sprintf("quota%d", time.Now().UnixNano())
	tp := startProxyOpts(t, up.URL, func(c *Config) {
		withTenants(ratelimit.ModeReject,
			ratelimit.Tenant{Name: "a", Keys: []string{"key-a"}, Limits: ratelimit.Limits{RequestsPerSecond: 0.01, Burst: 2}},
			ratelimit.Tenant{Name: "b", Keys: []string{"key-b"}})(c)
		c.Routes[0].Name = route
		c.SLO = metrics.SLO{E2E: 10 * time.Second, Target: 0.99}
	}, Options{MaxBufferedBodies: 4 << 10})
	for i := range 10 {
		resp, _ := postKey(t, tp.url+"/v1/chat/completions", "key-a", `{"model":"m"}`)
		rec := tp.rec.next(t)
		switch {
		case i < 2 && (resp.StatusCode != 200 || !rec.Good()):
			t.Fatalf("request %d within the limit: %d %+v", i, resp.StatusCode, rec)
		case i >= 2 && (resp.StatusCode != 429 || rec.Outcome != metrics.OutcomeLimited || rec.SLOJudged):
			t.Fatalf("request %d past the tenant's rate: %d, outcome %s, judged %v", i, resp.StatusCode, rec.Outcome, rec.SLOJudged)
		}
	}
	if resp, _ := postKey(t, tp.url+"/v1/chat/completions", "no-such-key", `{}`); resp.StatusCode != 401 {
		t.Fatalf("unknown key: %d", resp.StatusCode)
	}
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeLimited || rec.SLOJudged {
		t.Fatalf("unknown key's record: %s judged %v", rec.Outcome, rec.SLOJudged)
	}
	check := func(when string, count, errs, limited, judged, good int64) {
		t.Helper()
		rep := tp.p.Stats().Query(stats.Query{Window: "all", Route: route, GroupBy: []string{"route"}})
		if len(rep.Groups) != 1 {
			t.Fatalf("%s: %d groups", when, len(rep.Groups))
		}
		g := rep.Groups[0]
		if g.Count != count || g.Errors != errs || g.Limited != limited || g.Goodput.Judged != judged || g.Goodput.Good != good {
			t.Fatalf("%s: /stats count %d errors %d limited %d judged %d good %d; want %d %d %d %d %d",
				when, g.Count, g.Errors, g.Limited, g.Goodput.Judged, g.Goodput.Good, count, errs, limited, judged, good)
		}
		r := `route="` + route + `"`
		if j, gd := seriesSum("tokentap_slo_judged_requests_total", r), seriesSum("tokentap_goodput_requests_total", r); j != float64(judged) || gd != float64(good) {
			t.Fatalf("%s: metrics judged %v good %v, want %d %d", when, j, gd, judged, good)
		}
		if n := seriesSum("tokentap_requests_total", r, `outcome="limited"`); n != float64(limited) {
			t.Fatalf("%s: %v limited requests counted, want %d", when, n, limited)
		}
	}
	check("a tenant past its limits", 11, 0, 9, 2, 2)

	// The service fails: a 502 of the backend, and a 503 of tokentap's
	// own (the budget of request bodies is spent).
	if resp, _ := postKey(t, tp.url+"/v1/chat/completions?fail=1", "key-b", `{}`); resp.StatusCode != 502 {
		t.Fatalf("failing upstream: %d", resp.StatusCode)
	}
	tp.rec.next(t)
	if resp, _ := postKey(t, tp.url+"/v1/chat/completions", "key-b", `{"pad":"`+strings.Repeat("x", 8<<10)+`"}`); resp.StatusCode != 503 {
		t.Fatalf("past the body budget: %d", resp.StatusCode)
	}
	if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeRejected || !rec.SLOJudged || rec.Good() {
		t.Fatalf("tokentap unable to serve: %s judged %v", rec.Outcome, rec.SLOJudged)
	}
	check("and the service failing twice", 13, 2, 9, 4, 2)
}
