package metrics

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"sync"
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
	want += 3 + 2 + NumSLO - 2 // the unacked and qoe misses are made at their first use
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
	// A reader's objective: a stream that read under it is not good, a
	// whole response (no reading) is not judged on it.
	slo.QoE = 0.9
	f(func(r *Record) { r.Reading = Reading{Tokens: 20, QoE: 0.95} }, 0)
	f(func(r *Record) { r.Reading = Reading{Tokens: 20, QoE: 0.9} }, 0)
	f(func(r *Record) { r.Reading = Reading{Tokens: 20, QoE: 0.89} }, SLOQoE)
	f(func(r *Record) { r.TTFT, r.TPOT = Absent, Absent }, 0)
	if got := SLOQoE.String(); got != "qoe" {
		t.Errorf("String %q", got)
	}
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

// TestRoutesLearnModelsBounded: two rows of one route (two upstreams) and
// a route with a literal model; 8 goroutines ask for 20 model names each.
// The route labels its literal and exactly PerRoute of the others, the
// same index on both rows, each series with its route, upstream and
// model; every other name is "other"; a name that is no plain model name
// is never learned; the next Set keeps what was learned.
func TestRoutesLearnModelsBounded(t *testing.T) {
	route := fmt.Sprintf("learn-%d", idleRuns.Add(1))
	rows := []RouteRow{{Route: route, Upstream: "a"}, {Route: route, Upstream: "b"}, {Route: route + "-lit", Models: []string{"lit-1"}}}
	s := NewSet(rows, []string{"allowed"}, SetOptions{PerRoute: 3})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 20 {
				row := (g + i) % 2
				s.ModelIndex(row, []byte(fmt.Sprintf("m-%d", (g*7+i)%20)))
			}
		})
	}
	wg.Wait()
	learned := s.LearnedModels(route)
	if len(learned) != 3 {
		t.Fatalf("learned %v, want 3", learned)
	}
	for _, m := range learned {
		i0, i1 := s.ModelIndex(0, []byte(m)), s.ModelIndex(1, []byte(m))
		if i0 != i1 || i0 == s.OtherIndex() {
			t.Errorf("%s: index %d on a, %d on b", m, i0, i1)
		}
		for row, up := range []string{"a", "b"} {
			if r, u, mm := s.Series(row, i0).Labels(); r != route || u != up || mm != m {
				t.Errorf("%s on row %d: labels %s %s %s", m, row, r, u, mm)
			}
		}
	}
	if i := s.ModelIndex(0, []byte("m-new")); i != s.OtherIndex() {
		t.Errorf("a fourth model: index %d, want other's", i)
	}
	if i := s.ModelIndex(0, []byte("allowed")); i != 0 {
		t.Errorf("the allowlist's model: %d", i)
	}
	if _, _, m := s.Series(2, s.ModelIndex(2, []byte("lit-1"))).Labels(); m != "lit-1" {
		t.Errorf("the literal model's label %q", m)
	}
	if i := s.ModelIndex(2, []byte("has space")); i != s.OtherIndex() {
		t.Error("a name with a space was learned")
	}
	next := NewSet(rows, []string{"allowed"}, SetOptions{PerRoute: 3, Carry: s})
	if got := next.LearnedModels(route); !slices.Equal(got, learned) {
		t.Errorf("the next Set learned %v, want %v kept", got, learned)
	}
}
