package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

func TestExampleConfigLoads(t *testing.T) {
	s, err := parseFlags([]string{"-config", "../../configs/tokentap.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.proxy.Routes) != 2 || s.proxy.Routes[1].Timeouts.FirstByte != 20*time.Minute ||
		s.proxy.Routes[0].Timeouts.FirstByte != 10*time.Minute || !s.proxy.Routes[1].StripPrefix || s.proxy.Routes[1].Dialect != "ollama" {
		t.Fatalf("routes: %+v", s.proxy.Routes)
	}
	if len(s.proxy.Models) != 2 || s.listen != ":8080" || s.admin != "127.0.0.1:9090" || s.accessLog != "-" {
		t.Fatalf("settings: %+v", s)
	}
	want := metrics.SLO{TTFT: 2 * time.Second, TTFA: 10 * time.Second, TPOT: 100 * time.Millisecond, E2E: 5 * time.Minute, Target: 0.99, Measure: metrics.MeasureClient}
	if s.proxy.SLO != want || s.proxy.Routes[0].SLO != (metrics.SLO{TTFT: 500 * time.Millisecond}) ||
		s.proxy.SLO.Over(s.proxy.Routes[0].SLO).TTFT != 500*time.Millisecond || len(s.proxy.Buckets["ttft"]) != 12 ||
		s.proxy.Warn.MinRequests != 20 || s.proxy.Warn.QueueShare != 0.5 || s.proxy.Warn.OverheadP95 != 10*time.Millisecond {
		t.Fatalf("slo %+v, route slo %+v, buckets %v, warn %+v", s.proxy.SLO, s.proxy.Routes[0].SLO, s.proxy.Buckets, s.proxy.Warn)
	}
}

func TestFlagsOverrideFile(t *testing.T) {
	s, err := parseFlags([]string{"-config", "../../configs/tokentap.yaml", "-listen", ":9999", "-access-log", "", "-upstream", "http://10.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	if s.listen != ":9999" || s.accessLog != "" {
		t.Fatalf("flags not applied: %+v", s)
	}
	last := s.proxy.Routes[len(s.proxy.Routes)-1]
	if last.Name != "default" || last.Prefix != "/" || last.Upstream != "http://10.0.0.1:1" {
		t.Fatalf("-upstream with routes in the file: %+v", s.proxy.Routes)
	}
}

func TestUpstreamAloneMakesDefaultRoute(t *testing.T) {
	s, err := parseFlags([]string{"-upstream", "http://127.0.0.1:8000"})
	if err != nil {
		t.Fatal(err)
	}
	if len(s.proxy.Routes) != 1 || s.proxy.Routes[0].Name != "default" || s.proxy.Routes[0].Prefix != "/" {
		t.Fatalf("routes: %+v", s.proxy.Routes)
	}
	// A file without routes: -upstream still makes the default route.
	p := writeFile(t, "listen: \":7000\"\n")
	if s, err = parseFlags([]string{"-config", p, "-upstream", "http://127.0.0.1:8000"}); err != nil || s.listen != ":7000" || s.proxy.Routes[0].Name != "default" {
		t.Fatalf("%v %+v", err, s)
	}
}

func writeFile(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestConfigErrorsNameTheField(t *testing.T) {
	f := func(yaml string, args []string, want ...string) {
		t.Helper()
		if yaml != "" {
			args = append(args, "-config", writeFile(t, yaml))
		}
		_, err := parseFlags(args)
		if err == nil {
			t.Fatalf("no error for %q %v", yaml, args)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error %q lacks %q", err, w)
			}
		}
	}
	f("", nil, "upstream", "no routes")
	f("", []string{"-upstream", "ftp://x"}, "upstream", "http or https")
	f("", []string{"-bogus"}, "bogus")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    colour: red\n", nil, ":5", "routes[0].colour", "unknown field colour")
	f("listen: :1\nlistne: :2\n", nil, ":2:", "listne")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: \"htp://x\"\n", nil, ":4:", "routes[0].upstream", "http or https")
	f("routes:\n  - name: a\n    prefix: v1\n    upstream: http://x\n", nil, ":3:", "routes[0].prefix", "start with /")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n  - name: a\n    prefix: /b\n    upstream: http://x\n", nil, "routes[1].name", "duplicate")
	f("upstream: http://x\ntimeouts:\n  idle: 5x\n", nil, ":3:", "timeouts.idle", "5x")
	f("upstream: http://x\ntimeouts:\n  connect: 0s\n", nil, "timeouts.connect", "positive")
	f("upstream: http://x\nmodels:\n  enforce: true\n", nil, ":3:", "models.enforce")
	f("upstream: http://x\nmodels:\n  allow: [a, a]\n", nil, "models.allow[1]")
	f("upstream: http://x\nlimits:\n  max_event_bytes: -1\n", nil, ":3:", "limits.max_event_bytes")
	f("routes: 5\n", nil, ":1:", "routes")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    dialect: klingon\n", nil, ":5:", "routes[0].dialect", "klingon", "anthropic")
	// Accepted silently before: each now names its field.
	f("upstream: http://x\nlisten: \":99999\"\n", nil, ":2:", "listen", "65535")
	f("upstream: http://x\nadmin: \"127.0.0.1:70000\"\n", nil, ":2:", "admin", "65535")
	f("upstream: http://x\nlisten: \"8080\"\n", nil, "listen", "host:port")
	f("upstream: http://x\ntimeouts:\n  first_byte: 0s\n", nil, ":3:", "timeouts.first_byte", "positive")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    timeouts:\n      idle: 0s\n", nil, "routes[0].timeouts.idle", "positive")
	f("upstream: http://x\nlimits:\n  client_write_timeout: 0s\n", nil, ":3:", "limits.client_write_timeout", "positive")
	f("upstream: http://x\nlimits:\n  max_client_conns: -1\n", nil, ":3:", "limits.max_client_conns")
	f("upstream: http://x\ndrain_timeout: 0s\n", nil, ":2:", "drain_timeout", "positive")
	f("upstream: http://x\nrelay: epoll\n", nil, ":2:", "relay", "loop or goroutine")
	f("upstream: http://x\nslo:\n  target: 150%\n", nil, ":3:", "slo.target", "share")
	f("upstream: http://x\nslo:\n  ttft: fast\n", nil, ":3:", "slo.ttft", "fast")
	f("upstream: http://x\nslo:\n  measure: user\n", nil, ":3:", "slo.measure", "client or proxy")
	f("upstream: http://x\nslo:\n  qoe: 1.5\n", nil, ":3:", "slo.qoe", "share")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    qoe: {pace: slow}\n", nil, ":5:", "routes[0].qoe.pace", "slow")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    qoe: {speed: 1s}\n", nil, ":5:", "routes[0].qoe", "unknown field speed")
	ups := "routes:\n  - name: a\n    prefix: /\n"
	f(ups+"    upstream: http://x\n    upstreams: [{name: s, url: http://y}]\n", nil, ":5:", "routes[0].upstreams", "not both")
	f(ups+"    upstreams: [{name: s, url: http://y}, {name: s, url: http://z}]\n", nil, "routes[0].upstreams[1].name", "distinct")
	f(ups+"    upstreams: [{name: s, url: http://y, weight: -1}]\n", nil, "routes[0].upstreams[0].weight", "negative")
	f(ups+"    upstreams: [{name: s, url: ftp://y}]\n", nil, "routes[0].upstreams[0].url", "http or https")
	f(ups+"    upstreams: [{name: s, url: http://y, weight: 0}]\n", nil, ":4:", "routes[0].upstreams", "weight above 0")
	f(ups+"    upstreams: [{name: s, url: http://y}]\n    balance: fastest\n", nil, ":5:", "routes[0].balance", "least_inflight")
	f(ups+"    upstreams: [{name: s, url: http://y}]\n    sticky: \"header:\"\n", nil, ":5:", "routes[0].sticky", "header:NAME")
	f(ups+"    upstream: http://x\n    sticky: tenant\n", nil, "routes[0].balance", "need upstreams")
	two := ups + "    upstreams: [{name: s, url: http://y}, {name: c, url: http://z}]\n"
	f(two+"    guard: {candidate: x, baseline: s, max_ttft_p95_increase: 10%}\n", nil, "routes[0].guard.candidate", "not one of")
	f(two+"    guard: {candidate: c, baseline: c, max_ttft_p95_increase: 10%}\n", nil, "routes[0].guard.baseline")
	f(two+"    guard: {candidate: c, baseline: s, window: 2m, max_ttft_p95_increase: 10%}\n", nil, "routes[0].guard.window", "1m, 5m, 15m or 1h")
	f(two+"    guard: {candidate: c, baseline: s}\n", nil, "routes[0].guard", "at least one limit")
	f(two+"    shadow: {upstream: x, sample: 5%}\n", nil, "routes[0].shadow.upstream", "not one of")
	f(two+"    shadow: {upstream: c}\n", nil, "routes[0].shadow.sample", "above 0")
	f(two+"    failover: {on: [timeout]}\n", nil, "routes[0].failover.on[0]", "connect, status_5xx or first_token_timeout")
	f(two+"    failover: {on: [first_token_timeout]}\n", nil, "routes[0].failover.first_token_timeout", "positive")
	f(two+"    guard: {candidate: c, baseline: s, max_e2e_p95_increase: lots}\n", nil, ":5:", "routes[0].guard.max_e2e_p95_increase", "is not an increase")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    slo: {p99: 1s}\n", nil, ":5:", "routes[0].slo", "unknown field p99")
	f("upstream: http://x\nmetrics:\n  buckets:\n    ttft: [1, 0.5]\n", nil, ":4:", "metrics.buckets.ttft", "increasing")
	f("upstream: http://x\nmetrics:\n  buckets:\n    latency: [1]\n", nil, ":4:", "metrics.buckets.latency", "unknown measure")
	f("upstream: http://x\nwarnings:\n  overhead_p95: soon\n", nil, ":3:", "warnings.overhead_p95")
	f("upstream: http://x\nadmin:\n  listen: 127.0.0.1:0\n  token_file: /nonexistent/token\n", nil, ":4:", "admin.token_file")
	f("routes:\n  - name: a\n    prefix: //v1/\n    upstream: http://x\n", nil, ":3:", "routes[0].prefix", "normalised")
}

// The file's upstream with routes makes the catch-all route (as
// configs/tenants.yaml says), unless a route already has prefix /.
func TestRouteWithSeveralUpstreams(t *testing.T) {
	s, err := parseFlags([]string{"-config", writeFile(t, `routes:
  - name: chat
    prefix: /
    upstreams:
      - {name: stable, url: "http://10.0.0.1:8000", weight: 90}
      - {name: canary, url: "http://10.0.0.2:8000", weight: 10}
      - {name: spare, url: "http://10.0.0.3:8000"}
    balance: least_inflight
    sticky: "header:X-User"
    guard: {candidate: canary, baseline: stable, window: 1m, min_requests: 50, max_ttft_p95_increase: 10%, max_error_rate_increase: 1%}
    failover: {on: [connect, status_5xx, first_token_timeout], first_token_timeout: 2s}
    shadow: {upstream: spare, sample: 5%, max_inflight: 4}
`)})
	if err != nil {
		t.Fatal(err)
	}
	r := s.proxy.Routes[0]
	if len(r.Upstreams) != 3 || !reflect.DeepEqual(r.Upstreams[0], proxy.Upstream{Name: "stable", URL: "http://10.0.0.1:8000", Weight: 90}) ||
		r.Upstreams[1].Weight != 10 || r.Upstreams[2].Weight != 1 || r.Balance != "least_inflight" || r.Sticky != "header:X-User" ||
		r.Guard == nil || *r.Guard != (proxy.Guard{Candidate: "canary", Baseline: "stable", Window: "1m", MinRequests: 50, MaxTTFTP95Increase: 0.1, MaxErrorRateIncrease: 0.01}) ||
		r.Failover == nil || len(r.Failover.On) != 3 || r.Failover.FirstTokenTimeout != 2*time.Second ||
		r.Shadow == nil || *r.Shadow != (proxy.Shadow{Upstream: "spare", Sample: 0.05, MaxInflight: 4}) {
		t.Fatalf("route %+v", r)
	}
}

func TestFileUpstreamWithRoutesIsTheCatchAll(t *testing.T) {
	s, err := parseFlags([]string{"-config", "../../configs/tenants.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	last := s.proxy.Routes[len(s.proxy.Routes)-1]
	if len(s.proxy.Routes) != 2 || last.Name != "default" || last.Prefix != "/" || last.Upstream != "http://127.0.0.1:8000" {
		t.Fatalf("routes: %+v", s.proxy.Routes)
	}
	s, err = parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nroutes:\n  - name: root\n    prefix: /\n    upstream: http://b\n")})
	if err != nil || len(s.proxy.Routes) != 1 || s.proxy.Routes[0].Upstream != "http://b" {
		t.Fatalf("%v %+v", err, s)
	}
}

// The admin section: an address, or a mapping with a token file.
func TestAdminSection(t *testing.T) {
	tok := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tok, []byte("0123456789abcdef0123\n"), 0o600)
	s, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nadmin:\n  listen: 127.0.0.1:9191\n  token_file: "+tok+"\n")})
	if err != nil || s.admin != "127.0.0.1:9191" || s.adminTokenFile != tok {
		t.Fatalf("%v %+v", err, s)
	}
	os.WriteFile(tok, []byte("short\n"), 0o600)
	if _, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nadmin: {token_file: "+tok+"}\n")}); err == nil || !strings.Contains(err.Error(), "16 characters") {
		t.Fatalf("a short token: %v", err)
	}
	s, err = parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nadmin: \"127.0.0.1:9292\"\n")})
	if err != nil || s.admin != "127.0.0.1:9292" {
		t.Fatalf("%v %+v", err, s)
	}
}

func TestDemoRuns(t *testing.T) {
	wait.Long(t, "the demo's burst")
	var out strings.Builder
	if err := runDemo(context.Background(), []string{"-requests", "20", "-concurrency", "4"}, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{"TTFT p50", "TTFA p50", "chat", "completions", "anthropic", "ollama", "20 requests", "(0 client errors)",
		"cost and prompt cache:", "slow"} {
		if !strings.Contains(s, want) {
			t.Fatalf("demo output lacks %q:\n%s", want, s)
		}
	}
}

func TestDemoCanary(t *testing.T) {
	wait.Long(t, "the canary demo")
	var out strings.Builder
	if err := runDemo(context.Background(), []string{"-canary", "-requests", "160", "-concurrency", "8"}, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{"canary (", "against stable", "difference (95% interval)", "ttft p50 (ms)", "tokens/s per request", "guard:"} {
		if !strings.Contains(s, want) {
			t.Fatalf("demo -canary output lacks %q:\n%s", want, s)
		}
	}
}

func TestTenantsConfigLoads(t *testing.T) {
	s, err := parseFlags([]string{"-config", "../../configs/tenants.yaml"})
	if err != nil {
		t.Fatal(err)
	}
	ad := s.proxy.Admission
	if ad == nil || len(ad.Tenants) != 3 || ad.Mode != "queue" || ad.MaxQueue != 100 || ad.MaxWait != 2*time.Second || ad.UnknownKey != "guests" {
		t.Fatalf("admission: %+v", ad)
	}
	if slo := s.proxy.TenantSLOs["beta"]; slo != (metrics.SLO{TTFT: 10 * time.Second, Target: 0.9}) || len(s.proxy.TenantSLOs) != 1 {
		t.Fatalf("tenant SLOs %+v", s.proxy.TenantSLOs)
	}
	a := ad.Tenants[0]
	if a.Limits.RequestsPerSecond != 5 || a.Limits.Burst != 5 || a.Limits.TokensPerMinute != 20000 || a.Limits.MaxConcurrent != 4 ||
		a.Routes["chat"].MaxConcurrent != 2 || len(a.KeySHA256) != 1 || s.proxy.DefaultMaxOutput != 1024 ||
		a.Limits.USDPerDay != 20 || a.Limits.USDPerMonth != 400 {
		t.Fatalf("tenant alpha: %+v", a)
	}
	if b := ad.Tenants[1]; b.Limits.MaxConcurrent != 0 || b.Limits.RequestsPerSecond != 1 {
		t.Fatalf("absent limits must be off: %+v", b)
	}
}

func TestTenantConfigErrorsNameTheField(t *testing.T) {
	f := func(yaml string, want ...string) {
		t.Helper()
		_, err := parseFlags([]string{"-upstream", "http://x", "-config", writeFile(t, yaml)})
		if err == nil {
			t.Fatalf("no error for %q", yaml)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("error %q lacks %q", err, w)
			}
		}
	}
	f("tenants:\n  - name: a\n    requests_per_second: -1\n", ":3:", "tenants[0].requests_per_second")
	f("tenants:\n  - name: a\n    rps: 1\n", ":3:", "unknown field rps")
	f("tenants:\n  - name: a\nadmission:\n  mode: drop\n", ":4:", "admission.mode")
	f("tenants:\n  - name: a\nadmission:\n  unknown_key: nobody\n", ":4:", "admission.unknown_key")
	f("tenants:\n  - name: a\n    key_sha256: [abc]\n", ":3:", "tenants[0].key_sha256[0]")
	f("tenants:\n  - name: a\n    routes:\n      nosuch:\n        max_concurrent: 1\n", "tenants[0].routes.nosuch", "no route")
	f("admission:\n  mode: queue\n", ":1:", "admission", "tenants")
	f("tenants:\n  - name: a\nadmission:\n  max_wait: soon\n", ":4:", "admission.max_wait")
	f("tenants:\n  - name: a\nadmission:\n  mode: queue\n  max_queue: 0\n", ":5:", "admission.max_queue", "positive")
	f("tenants:\n  - name: a\nadmission:\n  max_wait: 0s\n", ":4:", "admission.max_wait", "positive")
	// A lease renewed every third of 2 ns panicked the reload; 1 ms cost
	// ~1,000 store calls a second from an idle replica.
	f("tenants:\n  - name: a\nadmission:\n  store:\n    redis: {addr: r:6379}\n    lease_ttl: 2ns\n", ":6:", "admission.store.lease_ttl", "below 1s")
	f("tenants:\n  - name: a\nadmission:\n  store:\n    redis: {addr: r:6379}\n    lease_ttl: 1ms\n", ":6:", "admission.store.lease_ttl")
	// Overload control: a priority the bands do not have, shedding with
	// no objective to judge by, a header that is no header name.
	f("tenants:\n  - name: a\n    priority: urgent\n", ":3:", "tenants[0].priority", "urgent", "critical, standard, sheddable")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    overload:\n      shed: true\n", ":6:", "routes[0].overload.shed", "slo.ttft")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    slo: {ttft: 1s}\n    overload:\n      shed: true\n      priority_header: \"X Priority\"\n", ":8:", "routes[0].overload.priority_header")
	f("routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    overload: {shed: yes please}\n", ":5:", "routes[0].overload.shed")
}

// An overload block and tenants' priorities reach the proxy's config:
// shedding by the route's objectives, by a request's own with
// slo_headers, the header named, a tenant's band.
func TestOverloadConfig(t *testing.T) {
	c, err := parseFlags([]string{"-config", writeFile(t, `
routes:
  - name: chat
    prefix: /
    upstream: http://x
    slo: {ttft: 500ms, tpot: 50ms}
    overload: {shed: true, priority_header: X-Priority}
  - name: batch
    prefix: /batch
    upstream: http://x
    overload: {shed: true, slo_headers: true}
tenants:
  - name: gold
    priority: critical
  - name: bulk
    priority: sheddable
  - name: plain
`)})
	if err != nil {
		t.Fatal(err)
	}
	p := c.proxy
	if o := p.Routes[0].Overload; o == nil || !o.Shed || o.PriorityHeader != "X-Priority" || o.SLOHeaders {
		t.Errorf("chat's overload: %+v", o)
	}
	if o := p.Routes[1].Overload; o == nil || !o.Shed || !o.SLOHeaders {
		t.Errorf("batch's overload: %+v", o)
	}
	if got := p.TenantPriorities; got["gold"] != proxy.PriorityCritical || got["bulk"] != proxy.PrioritySheddable || len(got) != 2 {
		t.Errorf("tenants' priorities %v", got)
	}
}

// TestConfigErrorsInFlowMaps: an error inside a one-line mapping names the
// key it is about and its line, not the line's last or longest key.
func TestConfigErrorsInFlowMaps(t *testing.T) {
	f := func(yaml, want string) {
		t.Helper()
		p := writeFile(t, yaml)
		_, err := parseFlags([]string{"-config", p})
		if err == nil {
			t.Fatalf("no error for %q", yaml)
		}
		if got := strings.TrimPrefix(err.Error(), p); !strings.HasPrefix(got, want) {
			t.Errorf("%q: error %q, want it to start with %q", yaml, got, want)
		}
	}
	// A bad duration.
	f("upstream: http://x\nslo: {ttft: 500, target: 99%}\n", `:2: slo.ttft: "500" is not a duration`)
	f("upstream: http://x\nslo: {target: 99%, ttft: 500}\n", `:2: slo.ttft: "500" is not a duration`)
	f("upstream: http://x\nslo: {ttft: 5s, e2e: 1s, tpot: 5, target: 99%}\n", `:2: slo.tpot: "5" is not a duration`)
	// A bad percentage.
	f("upstream: http://x\nslo: {target: 150%, ttft: 500ms}\n", `:2: slo.target: "150%" is not a share`)
	two := "routes:\n  - name: a\n    prefix: /\n    upstreams: [{name: s, url: http://y}, {name: c, url: http://z}]\n"
	f(two+"    shadow: {sample: 150%, max_inflight: 4}\n", `:5: routes[0].shadow.sample: "150%" is not a share`)
	// An unknown key.
	f("upstream: http://x\nslo: {ttft: 1s, p99: 1s, target: 99%}\n", `:2: slo.p99: unknown field p99`)
	f("upstream: http://x\nadmin: {listen: \"127.0.0.1:0\", colour: red}\n", `:2: admin.colour: unknown field colour`)
	// A value of the wrong type.
	f("upstream: http://x\ntimeouts: {max_conns: many, idle: 5s}\n", ":2: timeouts.max_conns: cannot unmarshal")
	// Nested flow maps in a flow sequence.
	f("routes: [{name: a, prefix: /, upstream: http://x, slo: {ttfa: 1s, e2e: soon}}]\n", `:1: routes[0].slo.e2e: "soon" is not a duration`)
	// Block style keeps naming its key.
	f("upstream: http://x\nslo:\n  ttft: 1s\n  target: 101%\n", `:4: slo.target: "101%" is not a share`)
}

// TestEmptyValuesTurnThingsOff: access_log: "" and admin: "" mean what
// configs/tokentap.yaml says (off), not "unset"; flags still win.
func TestEmptyValuesTurnThingsOff(t *testing.T) {
	f := func(yaml string, args []string, wantLog, wantAdmin string) {
		t.Helper()
		s, err := parseFlags(append([]string{"-config", writeFile(t, yaml)}, args...))
		if err != nil {
			t.Fatal(err)
		}
		if s.accessLog != wantLog || s.admin != wantAdmin {
			t.Errorf("%q %v: access log %q admin %q, want %q %q", yaml, args, s.accessLog, s.admin, wantLog, wantAdmin)
		}
	}
	f("upstream: http://x\n", nil, "-", "127.0.0.1:9090")
	f("upstream: http://x\naccess_log: \"\"\nadmin: \"\"\n", nil, "", "")
	f("upstream: http://x\naccess_log: \"\"\nadmin: {listen: \"\"}\n", nil, "", "")
	f("upstream: http://x\naccess_log: /tmp/a.log\nadmin: \"127.0.0.1:9191\"\n", nil, "/tmp/a.log", "127.0.0.1:9191")
	f("upstream: http://x\naccess_log: \"\"\nadmin: \"\"\n", []string{"-access-log", "-", "-admin", "127.0.0.1:9292"}, "-", "127.0.0.1:9292")
	f("upstream: http://x\naccess_log: \"-\"\n", []string{"-access-log", "", "-admin", ""}, "", "")
}

// TestConfigSaysWhatItMeans: guard increases past 100% can be set; a
// password in an upstream URL is used, never shown in an error.
func TestConfigSaysWhatItMeans(t *testing.T) {
	two := "routes:\n  - name: a\n    prefix: /\n    upstreams: [{name: s, url: http://y}, {name: c, url: http://z}]\n"
	s, err := parseFlags([]string{"-config", writeFile(t, two+"    guard: {candidate: c, baseline: s, max_ttft_p95_increase: 150%, max_e2e_p95_increase: 2.5}\n")})
	if err != nil {
		t.Fatal(err)
	}
	if g := s.proxy.Routes[0].Guard; g.MaxTTFTP95Increase != 1.5 || g.MaxE2EP95Increase != 2.5 {
		t.Errorf("guard %+v", g)
	}
	for yaml, want := range map[string]string{
		two + "    guard: {candidate: c, baseline: s, max_error_rate_increase: 150%}\n": `:5: routes[0].guard.max_error_rate_increase: "150%" is not a share`,
		two + "    guard: {candidate: c, baseline: s, max_ttft_p95_increase: -10%}\n":   `:5: routes[0].guard.max_ttft_p95_increase: "-10%" is not an increase`,
		"upstream: \"ftp://user:hunter2secret@x\"\n":                                    `upstream: "ftp://user:xxxxx@x": scheme must be http or https`,
		"upstream: \"http://user:hunter2secret@[::1\"\n":                                `upstream: "(an unparsable URL)": missing ']' in host`,
	} {
		p := writeFile(t, yaml)
		_, err := parseFlags([]string{"-config", p})
		if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("%q: error %v, want %q and no password", yaml, err, want)
		}
	}
	if _, err := parseFlags([]string{"-config", writeFile(t, "upstream: \"http://user:hunter2secret@127.0.0.1:8000\"\n")}); err != nil {
		t.Errorf("credentials in an upstream URL: %v", err)
	}
}

// The measurement section turns each measuring feature off by name; a
// value that is not a boolean names the field; the running program with
// the live stats off answers /stats and /stats/timeline with a 404 and a
// JSON error, and serves its requests and /metrics as before.
func TestMeasurementSection(t *testing.T) {
	s, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nmeasurement: {stats: false, client_side: false}\n")})
	if err != nil || !s.opts.NoStats || s.opts.NoSeries || !s.opts.NoClientSide {
		t.Fatalf("%v: stats off %v, series off %v, client side off %v", err, s.opts.NoStats, s.opts.NoSeries, s.opts.NoClientSide)
	}
	s, err = parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nmeasurement: {series: false, stats: true}\n")})
	if err != nil || s.opts.NoStats || !s.opts.NoSeries || s.opts.NoClientSide {
		t.Fatalf("%v: stats off %v, series off %v, client side off %v", err, s.opts.NoStats, s.opts.NoSeries, s.opts.NoClientSide)
	}
	if _, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nmeasurement:\n  stats: sometimes\n")}); err == nil ||
		!strings.Contains(err.Error(), ":3:") {
		t.Fatalf("a bad value: %v", err)
	}
	if _, err := parseFlags([]string{"-config", writeFile(t, "upstream: http://a\nmeasurement: {sketches: false}\n")}); err == nil ||
		!strings.Contains(err.Error(), "sketches") {
		t.Fatalf("an unknown switch: %v", err)
	}

	up := startBackend(t, time.Millisecond)
	listen, admin := freeAddr(t), freeAddr(t)
	cfg := writeFile(t, "upstream: "+up+"\nmeasurement: {stats: false}\n")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	postChats(t, listen, 1, 3)
	for _, path := range []string{"/stats", "/stats/timeline?route=default"} {
		var e map[string]any
		if code := getJSON(t, "http://"+admin+path, &e); code != 404 || !strings.Contains(fmt.Sprint(e["error"]), "measurement.stats") {
			t.Errorf("%s: %d %v", path, code, e)
		}
	}
	if code := status(t, "GET", "http://"+admin+"/metrics", ""); code != 200 {
		t.Errorf("/metrics: %d", code)
	}
}

// TestCheckWarnsOfAnUncappedPriorityHeader: -check accepts a route whose
// priority header no tenant caps, and says that the header claims at most
// standard there; with trust_priority_header it says nothing.
func TestCheckWarnsOfAnUncappedPriorityHeader(t *testing.T) {
	for _, trust := range []bool{false, true} {
		path := filepath.Join(t.TempDir(), "tokentap.yaml")
		conf := "routes:\n  - name: a\n    prefix: /\n    upstream: http://127.0.0.1:1\n    slo: {ttft: 1s}\n    overload: {shed: true, priority_header: X-Priority, trust_priority_header: " +
			strconv.FormatBool(trust) + "}\n"
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		check := exec.Command(os.Args[0], "-config", path, "-check")
		check.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
		out, err := check.CombinedOutput()
		warned := strings.Contains(string(out), "warning: routes[0].overload.priority_header") && strings.Contains(string(out), "at most standard")
		if err != nil || !strings.Contains(string(out), "config ok") || warned == trust {
			t.Errorf("trust %v: -check said %v\n%s", trust, err, out)
		}
	}
}

// TestCheckCatchesWhatCannotTakeEffect: -check refuses an empty models
// list with its field and line, and warns, naming each, of a price no
// route's models meet, forward_client_key without tenants known by key
// and trust_priority_header without a priority header.
func TestCheckCatchesWhatCannotTakeEffect(t *testing.T) {
	check := func(conf string) (string, error) {
		path := filepath.Join(t.TempDir(), "tokentap.yaml")
		if err := os.WriteFile(path, []byte(conf), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(os.Args[0], "-config", path, "-check")
		cmd.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := check("routes:\n  - name: a\n    prefix: /\n    models: []\n    upstream: http://127.0.0.1:1\n")
	if err == nil || !strings.Contains(out, ":4: routes[0].models: is empty") {
		t.Errorf("models: []: %v\n%s", err, out)
	}
	out, err = check("routes:\n  - name: a\n    prefix: /\n    models: [llama-*]\n    upstream: http://127.0.0.1:1\n    forward_client_key: true\n" +
		"    slo: {ttft: 1s}\n    overload: {trust_priority_header: true}\n" +
		"prices:\n  - {model: llama-3*, input: 1, output: 2}\n  - {model: gpt-4o*, input: 2.5, output: 10}\n")
	for _, want := range []string{`warning: prices[1].model: "gpt-4o*" meets no model a route names`, "warning: routes[0].forward_client_key: takes no effect",
		"warning: routes[0].overload.trust_priority_header: takes no effect without overload.priority_header", "config ok"} {
		if err != nil || !strings.Contains(out, want) {
			t.Errorf("want %q: %v\n%s", want, err, out)
		}
	}
	if strings.Contains(out, "prices[0]") {
		t.Errorf("a price a route's models meet was named:\n%s", out)
	}
}

// TestRouteReadingPace: a route's qoe times and an SLO's qoe score reach
// the proxy's config as written.
func TestRouteReadingPace(t *testing.T) {
	s, err := parseFlags([]string{"-config", writeFile(t, "routes:\n  - name: a\n    prefix: /\n    upstream: http://x\n    slo: {qoe: 90%}\n    qoe: {ttft: 800ms, pace: 40ms}\n")})
	if err != nil {
		t.Fatal(err)
	}
	r := s.proxy.Routes[0]
	if r.QoE != (proxy.Pace{TTFT: 800 * time.Millisecond, Read: 40 * time.Millisecond}) || r.SLO.QoE != 0.9 {
		t.Errorf("qoe %+v, slo %+v", r.QoE, r.SLO)
	}
}
