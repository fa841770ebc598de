package metrics

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestEveryFamilyHasHelp: with every kind of tokentap series in use, each
// tokentap family on the exposition has a HELP sentence, and the build
// info reads 1 with its labels.
func TestEveryFamilyHasHelp(t *testing.T) {
	route := fmt.Sprintf("help-%d", idleRuns.Add(1))
	s := NewSet([]RouteRow{{Route: route}}, []string{"m"}, SetOptions{SLO: true})
	s.AddTenants([]string{"t-" + route}, []string{"rate"}, func(string) (int64, int64) { return 1, 2 })
	s.AddGauge(`tokentap_guard_tripped{route="`+route+`",upstream="c"}`, func() float64 { return 0 })
	for _, g := range []string{"up", "calls", "call_failures", "call_seconds", "replicas", "releases_pending", "releases_dropped", "releases_retried"} {
		s.AddGauge("tokentap_admission_store_"+g, func() float64 { return 1 })
	}
	for _, g := range []string{"groups", "requests_folded", "groups_evicted"} {
		s.AddGauge("tokentap_stats_"+g, func() float64 { return 1 })
	}
	s.Register()
	defer s.Unregister()
	var rec Record
	rec.Reset()
	rec.Route, rec.Status, rec.Outcome, rec.Series, rec.TenantSeries = route, 200, OutcomeOK, s.Series(0, 0), s.Tenant("t-"+route)
	rec.TTFT, rec.E2E, rec.ServerQueue, rec.ServerPrefill, rec.ServerDecode = time.Millisecond, time.Second, time.Millisecond, time.Millisecond, time.Millisecond
	rec.Cost.USD, rec.CachedTokens, rec.CacheWriteTokens, rec.Tenant = 0.001, 10, 5, "t-"+route
	rec.UsageSource, rec.Stream = UsageProvider, true
	rec.Reading = Reading{Tokens: 10, QoE: 0.8, Fluidity: 0.9, Stall: 120 * time.Millisecond, Stalls: 1, HeldBy: HopUpstream}
	s.Observe(&rec)
	s.ModelIndex(0, []byte("a name that is folded"))
	rec.Cost.Basis, rec.UsageSource = CostUnpriced, UsageRejected
	s.Observe(&rec)
	BackendScrape(true)
	UpstreamConnDiscarded(DiscardExpired)
	UpstreamRetry()
	AcceptError()
	RelayLoopError("add")
	ConnRefused("total")
	FailedOver(route, "a", "connect")
	ShadowSkipped(route, "max_inflight")
	PlainHTTPOnTLS()
	Shed(route, "a", "sheddable")
	ClientConnClosedIdle("reset")
	H2Error("frame_too_large")
	H2Error("bad name {}")
	SetBuildInfo("v1.2.3", "abc123")

	var b bytes.Buffer
	WritePrometheus(&b, true)
	text := b.String()
	families := map[string]bool{}
	for _, l := range strings.Split(text, "\n") {
		name, ok := strings.CutPrefix(l, "# HELP ")
		if !ok || !strings.HasPrefix(name, "tokentap_") {
			continue
		}
		name, h, _ := strings.Cut(name, " ")
		families[name] = true
		if len(strings.TrimSpace(h)) < 20 {
			t.Errorf("family %s: HELP %q", name, h)
		}
	}
	for name := range help {
		if !families[name] {
			t.Errorf("family %s has a help text but is not on the exposition", name)
		}
	}
	if !strings.Contains(text, `tokentap_h2_errors_total{kind="other"} 1`) || !strings.Contains(text, `tokentap_h2_errors_total{kind="frame_too_large"} 1`) {
		t.Errorf("HTTP/2 errors not counted by kind, or a kind of another shape passed as a label")
	}
	if len(families) < 30 {
		t.Errorf("%d tokentap families on the exposition", len(families))
	}
	if !strings.Contains(text, `tokentap_build_info{version="v1.2.3",go_version="go`) || !strings.Contains(text, `revision="abc123"} 1`) {
		t.Errorf("no build info:\n%s", text)
	}
}
