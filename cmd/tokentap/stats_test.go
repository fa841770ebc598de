package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

const statsConfig = `
routes:
  - name: statsroute
    prefix: /
    upstream: %UPSTREAM%
    slo: {ttft: 1ms}
  # Two upstreams under a guard (two requests only, for the prompt cache's
  # counters): its series and gauge are on /metrics, as the Grafana
  # dashboard's per-upstream panels query them.
  - name: statsroute-canary
    prefix: /canary
    upstreams:
      - {name: stable, url: %UPSTREAM%}
      - {name: canary, url: %UPSTREAM%}
    guard: {candidate: canary, baseline: stable, max_error_rate_increase: 1%}
slo: {e2e: 60s, target: 99%}
models: {allow: [m]}
prices: [{model: m, input: 1.5, output: 6}]
metrics:
  buckets:
    queue: [0.001, 0.5, 5]
warnings: {min_requests: 5}
tenants:
  - name: guests
    keys: [key-guests-0123456789]
admission: {unknown_key: guests}
`

// getJSON decodes url's answer into v and returns its status.
var statsRuns atomic.Int64

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	code, b := get(t, url)
	if err := json.Unmarshal([]byte(b), v); err != nil {
		t.Fatalf("%s: %v: %s", url, err, b)
	}
	return code
}

func getText(t *testing.T, url string) string {
	t.Helper()
	_, b := get(t, url)
	return b
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStatsEndToEnd runs the program with SLOs, sends traffic, and reads
// what a user reads: /stats (its schema, filters and errors),
// /stats/timeline, the access log's SLO fields, /metrics (HELP/TYPE,
// configured buckets, goodput counters), `tokentap stats`, and checks the
// example Grafana dashboard and Prometheus rules against it.
func TestStatsEndToEnd(t *testing.T) {
	// A prompt cache: the canary route's two requests below share a long
	// system prompt, and the second's cached tokens are counted.
	upstream := startMockllm(t, mockllm.Options{TokenGap: time.Millisecond, PrefillBase: time.Millisecond, PrefixCache: true})
	cfg := filepath.Join(t.TempDir(), "tokentap.yaml")
	// Series live for the process: a route of its own per run (-count).
	route := fmt.Sprintf("statsroute%d", statsRuns.Add(1))
	conf := strings.NewReplacer("%UPSTREAM%", upstream, "statsroute", route).Replace(statsConfig)
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", logPath})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	const n = 12
	postChats(t, listen, 1, n)
	if t.Failed() {
		t.FailNow()
	}
	// Two requests on the canary route with one long system prompt: the
	// second is served from the backend's prompt cache.
	long := strings.Repeat("the same system prompt ", 100)
	for range 2 {
		resp, err := http.Post("http://"+listen+"/canary/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","max_tokens":4,"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"system","content":"`+long+`"},{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	base := "http://" + admin
	var rep map[string]any
	deadline := time.Now().Add(30 * time.Second) // records come as the clients' ACKs do: wait for them
	for {
		getJSON(t, base+"/stats?route="+route, &rep)
		if gs := rep["groups"].([]any); len(gs) == 1 && gs[0].(map[string]any)["count"].(float64) == n || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The schema, field by field.
	for _, k := range []string{"window", "window_s", "generated_at", "groups", "warnings"} {
		if _, ok := rep[k]; !ok {
			t.Errorf("/stats lacks %q", k)
		}
	}
	if rep["window"] != "5m" {
		t.Errorf("default window %v", rep["window"])
	}
	g := rep["groups"].([]any)[0].(map[string]any)
	for _, k := range []string{"route", "model", "tenant", "upstream", "count", "errors", "requests_per_s", "output_tokens_per_s", "goodput"} {
		if _, ok := g[k]; !ok {
			t.Errorf("group lacks %q", k)
		}
	}
	if g["route"] != route || g["model"] != "m" || g["tenant"] != "guests" || g["count"] != float64(n) {
		t.Errorf("group %v", g)
	}
	for _, m := range []string{"ttft_ms", "ttfa_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms", "overhead_ms", "upstream_ttfb_ms"} {
		d, ok := g[m].(map[string]any)
		if !ok {
			t.Errorf("group lacks %q", m)
			continue
		}
		for _, k := range []string{"p50", "p90", "p95", "p99", "max", "mean", "count"} {
			if _, ok := d[k].(float64); !ok {
				t.Errorf("%s lacks %q", m, k)
			}
		}
	}
	gp := g["goodput"].(map[string]any)
	// A 1 ms TTFT objective: no request is good, every one missed ttft.
	if gp["judged"] != float64(n) || gp["good"] != 0.0 || gp["ratio"] != 0.0 || gp["target"] != 0.99 ||
		gp["missed"].(map[string]any)["ttft"] != float64(n) || gp["missed"].(map[string]any)["e2e"] != 0.0 {
		t.Errorf("goodput %v", gp)
	}
	var warned bool
	for _, w := range rep["warnings"].([]any) {
		warned = warned || w.(map[string]any)["kind"] == "goodput"
	}
	if !warned {
		t.Errorf("no goodput warning: %v", rep["warnings"])
	}

	// Filters and refusals.
	var other map[string]any
	getJSON(t, base+"/stats?route="+route+"&model=nope&window=1h", &other)
	if len(other["groups"].([]any)) != 0 || other["window"] != "1h" {
		t.Errorf("model filter: %v", other)
	}
	for _, q := range []string{"window=2m", "group_by=path"} {
		var e map[string]any
		if code := getJSON(t, base+"/stats?"+q, &e); code != 400 || e["error"] == nil {
			t.Errorf("%s: %d %v", q, code, e)
		}
	}
	var tl map[string]any
	getJSON(t, base+"/stats/timeline?route="+route, &tl)
	routes := tl["routes"].([]any)
	pts := routes[0].(map[string]any)["points"].([]any)
	var counted float64
	for _, p := range pts {
		counted += p.(map[string]any)["count"].(float64)
	}
	if len(routes) != 1 || counted != n {
		t.Errorf("timeline: %d routes, %v requests", len(routes), counted)
	}

	// The terminal table.
	// -admin as a URL and as host:port, as tokentap's own -admin takes it.
	for _, a := range []string{base, admin} {
		var out strings.Builder
		if err := runStats(context.Background(), []string{"-admin", a, "-window", "5m", "-route", route}, &out); err != nil {
			t.Fatal(err)
		}
		if s := out.String(); !strings.Contains(s, route) || !strings.Contains(s, "  12 ") || !strings.Contains(s, "0.0%") || !strings.Contains(s, "[goodput]") ||
			!strings.Contains(s, "cost and prompt cache:") {
			t.Errorf("tokentap stats -admin %s printed:\n%s", a, s)
		}
	}

	// /metrics: HELP and TYPE, the configured queue buckets, goodput.
	// The canary route's two streams are recorded as their clients' ACKs
	// come: wait for the second's cache counters.
	metricsText := getText(t, base+"/metrics")
	for end := time.Now().Add(30 * time.Second); !strings.Contains(metricsText, `cache="hit"`) && time.Now().Before(end); {
		time.Sleep(20 * time.Millisecond)
		metricsText = getText(t, base+"/metrics")
	}
	for _, want := range []string{
		"# HELP tokentap_ttft_seconds", "# TYPE tokentap_ttft_seconds histogram",
		`tokentap_ttft_seconds_bucket{route="statsroute",model="m",le="0.5"}`,
		`tokentap_queue_seconds_bucket{route="statsroute",model="m",le="0.5"}`,
		`tokentap_slo_judged_requests_total{route="statsroute",model="m"} 12`,
		`tokentap_goodput_requests_total{route="statsroute",model="m"} 0`,
		`tokentap_slo_missed_total{route="statsroute",model="m",slo="ttft"} 12`,
		`tokentap_cost_usd_total{route="statsroute",model="m",tenant="guests"} `,
	} {
		if want = strings.ReplaceAll(want, "statsroute", route); !strings.Contains(metricsText, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	// Every tokentap family says what it measures; the build is named.
	for _, l := range strings.Split(metricsText, "\n") {
		if name, ok := strings.CutPrefix(l, "# HELP tokentap_"); ok && !strings.Contains(name, " ") {
			t.Errorf("empty HELP: %s", l)
		}
	}
	if !strings.Contains(metricsText, `tokentap_build_info{version="`) || !strings.Contains(metricsText, `,go_version="go`) {
		t.Errorf("/metrics lacks tokentap_build_info")
	}
	if strings.Contains(metricsText, `tokentap_queue_seconds_bucket{route="`+route+`",model="m",le="0.1"}`) {
		t.Errorf("queue buckets are not the configured ones")
	}

	// The access log's SLO fields.
	prog.stop()
	lines := logLines(t, logPath)
	if len(lines) != n+2 {
		t.Fatalf("%d log lines, want %d", len(lines), n+2)
	}
	if c, _ := lines[n+1]["cached_tokens"].(float64); c <= 0 {
		t.Errorf("the second request of one long prompt: cached_tokens %v", lines[n+1]["cached_tokens"])
	}
	if l := lines[0]; l["slo_ok"] != false || len(l["slo_missed"].([]any)) != 1 || l["slo_missed"].([]any)[0] != "ttft" {
		t.Errorf("access log SLO fields: %v %v", l["slo_ok"], l["slo_missed"])
	}

	// Every metric the Grafana dashboard and the Prometheus rules query
	// is one tokentap exposes.
	checkQueriedMetrics(t, metricsText)
}

var (
	metricName = regexp.MustCompile(`tokentap_[a-z0-9_]+`)
	// A name in a query; one with a colon is a recording rule's.
	queriedName = regexp.MustCompile(`[a-zA-Z0-9_:]*tokentap_[a-zA-Z0-9_:]*`)
)

func checkQueriedMetrics(t *testing.T, metricsText string) {
	t.Helper()
	exposed := map[string]bool{}
	for _, line := range strings.Split(metricsText, "\n") {
		if name := metricName.FindString(line); name != "" && strings.HasPrefix(line, name) {
			exposed[name] = true
		}
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Query any `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	b, err := os.ReadFile("../../examples/grafana/tokentap-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("dashboard JSON: %v", err)
	}
	var queries []string
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			queries = append(queries, tg.Expr)
		}
	}
	for _, v := range dash.Templating.List {
		if s, ok := v.Query.(string); ok {
			queries = append(queries, s)
		}
	}
	rules, err := os.ReadFile("../../examples/prometheus/tokentap-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	queries = append(queries, string(rules))
	for _, q := range queries {
		for _, name := range queriedName.FindAllString(q, -1) {
			if !strings.Contains(name, ":") && !exposed[name] {
				t.Errorf("%s is queried but not on /metrics", name)
			}
		}
	}
	if len(dash.Panels) < 8 {
		t.Errorf("%d panels", len(dash.Panels))
	}
}

// TestPrometheusRules checks the example rules with promtool, and runs
// their unit tests (tokentap-rules.test.yml).
func TestPrometheusRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("promtool is missing: .ci/run installs Debian's prometheus package")
		}
		t.Skip("promtool not installed (Debian: apt-get install prometheus)")
	}
	for _, args := range [][]string{{"check", "rules", "tokentap-rules.yml"}, {"test", "rules", "tokentap-rules.test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "../../examples/prometheus"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %v: %v\n%s", args, err, out)
		}
	}
}

// TestCompareEndToEnd: a route split 50/50 between two simulated backends
// whose prefill differs by 50%: /stats?compare and `tokentap compare`
// find the TTFT difference outside the noise, with its interval. (At 10%
// a machine running many test suites at once added enough to both sides
// to hide it, once in about 40 runs; the verdict's power on small
// differences is measured in metrics/stats, without a machine's load.)
func TestCompareEndToEnd(t *testing.T) {
	wait.Long(t, "two upstreams compared through the binary")
	start := func(prefill time.Duration) string {
		return startMockllm(t, mockllm.Options{PrefillBase: prefill, TokenGap: time.Millisecond, Jitter: 0.05})
	}
	a, b := start(40*time.Millisecond), start(60*time.Millisecond)
	route := fmt.Sprintf("cmp%d", statsRuns.Add(1))
	cfg := writeFile(t, fmt.Sprintf("routes:\n  - name: %s\n    prefix: /\n    upstreams:\n      - {name: stable, url: %q}\n      - {name: canary, url: %q}\n", route, a, b))
	listen, admin := freeAddr(t), freeAddr(t)
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	postChats(t, listen, 4, 60)
	base := "http://" + admin
	var c stats.Comparison
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) { // an event, not a time
		getJSON(t, base+"/stats?route="+route+"&compare=stable,canary&window=all", &c)
		if c.CountA+c.CountB == 240 || time.Now().After(deadline) {
			break
		}
	}
	if c.CountA+c.CountB != 240 || c.CountA < 80 || c.CountB < 80 {
		t.Fatalf("counts %d + %d", c.CountA, c.CountB)
	}
	var p50 stats.Diff
	for _, d := range c.Measures {
		if d.Name == "ttft_ms" && d.Quantile == "p50" {
			p50 = d
		}
	}
	if !p50.Significant || p50.RelativeDiff < 0.15 || p50.RelativeDiff > 0.8 || p50.CILow <= 0 {
		t.Errorf("TTFT p50: %+v, want about +50%% outside the noise", p50)
	}
	var out strings.Builder
	if err := runCompare(context.Background(), []string{"-admin", base, "-route", route, "-window", "all", "stable", "canary"}, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if !strings.Contains(s, "ttft p50 (ms)") || !strings.Contains(s, "outside the noise") || !strings.Contains(s, "verdict: canary worse:") || !strings.Contains(s, "ttft p50 +") {
		t.Errorf("tokentap compare printed:\n%s", s)
	}
	// The verdict first, the rows that matter, a line a class: short.
	if n := strings.Count(s, "\n"); n > 16 || strings.Contains(s, "intervals:") {
		t.Errorf("tokentap compare printed %d lines (want the verdict, not every row):\n%s", n, s)
	}
	out.Reset()
	if err := runCompare(context.Background(), []string{"-admin", base, "-route", route, "-window", "all", "-v", "stable", "canary"}, &out); err != nil {
		t.Fatal(err)
	}
	if v := out.String(); strings.Count(v, "\n") <= strings.Count(s, "\n") || !strings.Contains(v, "intervals:") {
		t.Errorf("tokentap compare -v printed no more than without it:\n%s", v)
	}
	for _, q := range []string{"compare=stable", "compare=stable,nope", "compare=a,b&route="} {
		var e map[string]any
		if code := getJSON(t, base+"/stats?route="+route+"&"+q, &e); code < 400 || e["error"] == nil {
			t.Errorf("%s: %d %v", q, code, e)
		}
	}
}

// TestStatsAcrossReplicas: three tokentaps in front of backends of
// different speeds, each with its own access log. `tokentap stats` given
// the three admin listeners merges their sketches into one table whose
// TTFT and E2E p50, p95 and p99 are those of all requests together (the
// exact ones, from the three access logs) within the sketches' accuracy.
// (The merged verdict of `tokentap compare` is the one over all requests:
// TestMergeSketchesEqualsOneEngine.)
func TestStatsAcrossReplicas(t *testing.T) {
	wait.Long(t, "three replicas' statistics merged")
	var admins, logs []string
	var progs []*runner
	const perReplica = 60
	for i, prefill := range []time.Duration{5 * time.Millisecond, 20 * time.Millisecond, 60 * time.Millisecond} {
		up := startMockllm(t, mockllm.Options{PrefillBase: prefill, TokenGap: time.Millisecond})
		listen, admin := freeAddr(t), freeAddr(t)
		logPath := filepath.Join(t.TempDir(), fmt.Sprintf("access%d.log", i))
		p := startRun(t, []string{"-upstream", up, "-listen", listen, "-admin", admin, "-access-log", logPath})
		defer p.stop()
		progs = append(progs, p)
		waitUp(t, "http://"+admin+"/healthz")
		postChats(t, listen, 1, perReplica)
		if t.Failed() {
			t.FailNow()
		}
		admins, logs = append(admins, admin), append(logs, logPath)
	}
	// Every record is in (a record waits for its client's last ACK).
	for _, adm := range admins {
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			var r stats.Report
			getJSON(t, "http://"+adm+"/stats?window=all&group_by=route", &r)
			if len(r.Groups) == 1 && r.Groups[0].Count == perReplica {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: records %+v", adm, r.Groups)
			}
		}
	}
	var out strings.Builder
	if err := runStats(context.Background(), []string{"-admin", strings.Join(admins, ","), "-window", "all", "-group-by", "route", "-json"}, &out); err != nil {
		t.Fatal(err)
	}
	var merged stats.Report
	if err := json.Unmarshal([]byte(out.String()), &merged); err != nil {
		t.Fatalf("%v: %s", err, out.String())
	}
	var text strings.Builder
	if err := runStats(context.Background(), []string{"-admin", strings.Join(admins, ","), "-window", "all"}, &text); err != nil || !strings.Contains(text.String(), "3 replicas merged") {
		t.Errorf("the table: %v\n%s", err, text.String())
	}
	for _, p := range progs {
		p.stop() // flushes the access logs
	}
	exact := map[string][]float64{}
	for _, l := range logs {
		for _, line := range logLines(t, l) {
			for _, f := range []string{"ttft_ms", "e2e_ms"} {
				if v, ok := line[f].(float64); ok {
					exact[f] = append(exact[f], v)
				}
			}
		}
	}
	if len(merged.Groups) != 1 || merged.Groups[0].Count != 3*perReplica || len(exact["ttft_ms"]) != 3*perReplica {
		t.Fatalf("merged %d groups (%+v), %d logged TTFTs", len(merged.Groups), merged.Groups, len(exact["ttft_ms"]))
	}
	g := merged.Groups[0]
	for f, d := range map[string]stats.Dist{"ttft_ms": g.TTFT, "e2e_ms": g.E2E} {
		s := exact[f]
		slices.Sort(s)
		for q, got := range map[float64]float64{0.5: d.P50, 0.95: d.P95, 0.99: d.P99} {
			want := s[int(math.Floor(q*float64(len(s)-1)))]
			// The sketches' 0.5%, the log's and the table's rounding.
			if math.Abs(got-want) > 0.01*want+0.002 {
				t.Errorf("%s p%v: merged %v, exact over all three logs %v", f, 100*q, got, want)
			}
		}
	}
}

// postChats sends each of workers clients' n streamed chats through the
// proxy at listen, reading each answer whole.
func postChats(t *testing.T, listen string, workers, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range n {
				resp, err := http.Post("http://"+listen+"/v1/chat/completions", "application/json",
					strings.NewReader(`{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`))
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
}

// A replica (or something posing as one) that answers a sketch no
// tokentap gives makes `tokentap stats` and `compare` across replicas fail
// with a message, not a panic, and without the memory its indexes name.
func TestStatsRefusesAHostileReplica(t *testing.T) {
	hostile := `{"format":"` + stats.SketchFormat + `","window":"all","window_s":10,"generated_at":"2026-01-01T00:00:00Z","groups":[{"route":"chat","model":"m","tenant":"","upstream":"","count":1,"errors":0,"output_tokens":0,"slo_judged":0,"slo_good":0,"slo_missed":[0,0,0,0,0,0,0],"held_by":[0,0,0,0],"measures":[` +
		// One TTFT value in a bin past 2^32 (contiguous counts at index 2^33).
		`{"n":1,"sum":1,"max":1,"sketch":"BQGAgICAQAI="}` + strings.Repeat(`,{"n":0,"sum":0,"max":0}`, len(stats.MeasureNames())-1) + `]}]}`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, hostile)
	}))
	defer srv.Close()
	a := strings.TrimPrefix(srv.URL, "http://")
	for _, args := range [][]string{{"stats", "-admin", a + "," + a}, {"compare", "-admin", a + "," + a, "-route", "chat", "a", "b"}} {
		var out strings.Builder
		var err error
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("%s panicked: %v", args[0], r)
				}
			}()
			if args[0] == "stats" {
				err = runStats(context.Background(), args[1:], &out)
			} else {
				err = runCompare(context.Background(), args[1:], &out)
			}
		}()
		if err == nil || !strings.Contains(err.Error(), "refused") {
			t.Errorf("%s across a hostile replica: %v, want a refusal", args[0], err)
		}
	}
}
