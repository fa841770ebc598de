package metrics

import (
	"bytes"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
)

var idleRuns atomic.Int64

func scrape(t *testing.T, label string) (lines []string, text string) {
	t.Helper()
	var b bytes.Buffer
	vm.WritePrometheus(&b, false)
	for _, l := range strings.Split(b.String(), "\n") {
		if strings.Contains(l, label) {
			lines = append(lines, l)
		}
	}
	return lines, b.String()
}

// TestIdleSeriesPerRouteAndModel counts what an idle scrape exposes per
// route × model: 10 histograms with the default buckets, 3 token
// counters, and with SLOs 7 goodput counters. Request counters and the
// server-timing histograms appear at their first use.
func TestIdleSeriesPerRouteAndModel(t *testing.T) {
	// Series live for the process: a route of its own per run (-count).
	route := fmt.Sprintf("idle-count-%d", idleRuns.Add(1))
	s := NewSet([]RouteRow{{Route: route}}, []string{"m"}, SetOptions{SLO: true})
	s.Register()
	defer s.Unregister()
	lines, text := scrape(t, `route="`+route+`",model="m"`)
	want := 0
	for _, m := range []string{"ttft", "ttfa", "itl", "tpot", "e2e", "queue", "overhead", "upstream_ttfb", "client_ttft", "client_e2e"} {
		want += len(DefaultBuckets[m]) + 3 // buckets, +Inf, _sum, _count
	}
	want += 3 + 2 + NumSLO - 1 // the unacked miss is made at its first use
	if len(lines) != want {
		t.Errorf("%d series per route × model, want %d:\n%s", len(lines), want, strings.Join(lines, "\n"))
	}
	if want > 150 {
		t.Errorf("%d series per route × model: more than 150", want)
	}
	for _, h := range []string{"# HELP tokentap_ttft_seconds", "# TYPE tokentap_ttft_seconds histogram", "# TYPE tokentap_goodput_requests_total counter"} {
		if !strings.Contains(text, h) {
			t.Errorf("no %q line", h)
		}
	}
	if !strings.Contains(text, `tokentap_ttft_seconds_bucket{route="`+route+`",model="m",le="0.5"}`) {
		t.Errorf("no 0.5 s TTFT bucket")
	}

	// One request: its outcome × status counter, and server timings.
	var r Record
	r.Reset()
	r.Series, r.Outcome, r.Status, r.ServerPrefill, r.E2E = s.Series(0, 0), OutcomeOK, 200, 40*time.Millisecond, time.Second
	SLO{E2E: 2 * time.Second}.Judge(&r)
	s.Observe(&r)
	_, text = scrape(t, `route="`+route+`"`)
	for _, w := range []string{
		`tokentap_requests_total{route="idle-count",model="m",outcome="ok",status_class="2xx"} 1`,
		`tokentap_server_prefill_seconds_count{route="idle-count",model="m"} 1`,
		`tokentap_goodput_requests_total{route="idle-count",model="m"} 1`,
		`tokentap_slo_judged_requests_total{route="idle-count",model="m"} 1`,
	} {
		if w = strings.ReplaceAll(w, "idle-count", route); !strings.Contains(text, w) {
			t.Errorf("after one request, no %s", w)
		}
	}
}

func TestSLOJudge(t *testing.T) {
	slo := SLO{TTFT: 500 * time.Millisecond, TPOT: 50 * time.Millisecond, E2E: 10 * time.Second}
	f := func(edit func(*Record), want SLOMisses) {
		t.Helper()
		var r Record
		r.Reset()
		r.Outcome, r.TTFT, r.TPOT, r.E2E = OutcomeOK, 400*time.Millisecond, 40*time.Millisecond, 5*time.Second
		edit(&r)
		slo.Judge(&r)
		if !r.SLOJudged || r.SLOMisses != want {
			t.Errorf("missed %q, want %q", r.SLOMisses, want)
		}
	}
	f(func(r *Record) {}, 0)
	f(func(r *Record) { r.TTFT = 500 * time.Millisecond }, 0) // at the objective is met
	f(func(r *Record) { r.TTFT = 501 * time.Millisecond }, SLOTTFT)
	f(func(r *Record) { r.TTFT, r.TPOT = Absent, Absent }, 0) // not streamed: nothing to judge there
	f(func(r *Record) { r.Outcome, r.E2E = OutcomeUpstreamTimeout, 11*time.Second }, SLOFailed|SLOE2E)
	f(func(r *Record) { r.TPOT = 60 * time.Millisecond; r.Outcome = OutcomeClientCancel }, SLOTPOT|SLOFailed)
	var r Record
	r.Reset()
	SLO{}.Judge(&r)
	if r.SLOJudged {
		t.Error("judged without objectives")
	}
	if got := (SLOTTFT | SLOFailed).String(); got != "ttft,failed" {
		t.Errorf("String %q", got)
	}
	over := SLO{TTFT: time.Second, E2E: time.Minute, Target: 0.99}.Over(SLO{TTFT: 200 * time.Millisecond})
	if over != (SLO{TTFT: 200 * time.Millisecond, E2E: time.Minute, Target: 0.99}) {
		t.Errorf("Over: %+v", over)
	}
}
