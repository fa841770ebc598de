package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
)

// TestOneTablePerQuestion: tokentap stats' tables. Two rows of one route,
// model and tenant that differ by upstream carry an upstream column (they
// read alike without it), in the cost table too; without upstreams there
// is none; a route of whole responses shows "-" for its TTFT, never 0;
// refusals have a column of their own; where nothing was judged, a line
// says how to set an SLO.
func TestOneTablePerQuestion(t *testing.T) {
	ratio := 0.5
	g := func(up string, ttft int64) stats.Group {
		return stats.Group{Route: "chat", Model: "m", Tenant: "default", Upstream: up, Count: 10, Refused: 3, Priced: 7, CostUSD: 0.01,
			TTFT: stats.Dist{Count: ttft, P50: 12.5, P95: 20, P99: 30}, E2E: stats.Dist{Count: 7, P50: 100, P95: 200, P99: 300}}
	}
	var out bytes.Buffer
	printStats(&out, stats.Report{Groups: []stats.Group{g("stable", 7), g("canary", 0)}})
	text := out.String()
	lines := strings.Split(text, "\n")
	if !strings.Contains(lines[0], "upstream") || !strings.Contains(lines[0], "refused") {
		t.Errorf("the header %q lacks upstream or refused", lines[0])
	}
	if !strings.Contains(lines[1], "stable") || !strings.Contains(lines[2], "canary") {
		t.Errorf("rows do not name their upstream:\n%s", text)
	}
	if f := strings.Fields(lines[2]); len(f) < 12 || f[9] != "-" || f[10] != "-" {
		t.Errorf("the canary row's TTFT (nothing measured) is not -: %q", lines[2])
	}
	if !strings.Contains(text, "no SLO set") || !strings.Contains(text, "-slo ttft=500ms") {
		t.Errorf("no word on how to set an SLO:\n%s", text)
	}
	cost := text[strings.Index(text, "cost and prompt cache:"):]
	if !strings.Contains(strings.Split(cost, "\n")[1], "upstream") {
		t.Errorf("the cost table has no upstream column:\n%s", cost)
	}
	out.Reset()
	one := g("", 7)
	one.Goodput = stats.Goodput{Judged: 7, Good: 3, Ratio: &ratio}
	printStats(&out, stats.Report{Groups: []stats.Group{one}})
	if strings.Contains(out.String(), "upstream") || strings.Contains(out.String(), "no SLO set") || !strings.Contains(out.String(), "50.0%") {
		t.Errorf("one route, one upstream, an SLO:\n%s", out.String())
	}
}

// TestSLOFlag: -slo sets the default objectives in one flag, over the
// file's; a bad one names what is wrong.
func TestSLOFlag(t *testing.T) {
	s, err := parseFlags([]string{"-upstream", "http://127.0.0.1:1", "-slo", "ttft=500ms,tpot=50ms,qoe=0.9,target=0.99"})
	if err != nil {
		t.Fatal(err)
	}
	if slo := s.proxy.SLO; slo.TTFT != 500*time.Millisecond || slo.TPOT != 50*time.Millisecond || slo.Target != 0.99 || slo.QoE != 0.9 {
		t.Errorf("SLO %+v", slo)
	}
	for _, bad := range []string{"ttft", "ttft=fast", "speed=1s", "target=2", "qoe=1.5", "qoe=0"} {
		if _, err := parseFlags([]string{"-upstream", "http://127.0.0.1:1", "-slo", bad}); err == nil || !strings.Contains(err.Error(), "-slo") {
			t.Errorf("-slo %s: %v", bad, err)
		}
	}
}

// TestStatsPrintsHowStreamsRead: tokentap stats has a table of how
// streams read where any was, with the low tail of the scores and the hop
// that held most stalled streams; none without a reading.
func TestStatsPrintsHowStreamsRead(t *testing.T) {
	g := stats.Group{Route: "chat", Model: "m", Tenant: "default", Count: 40,
		Reading: &stats.Reading{Streams: 40, StallRate: 0.125, QoE: stats.Dist{Count: 40, P50: 1, P99: 0.612}, Fluidity: stats.Dist{Count: 40, P50: 1, P99: 0.7},
			StallMS: stats.Dist{Count: 40, P99: 812.5}, HeldBy: map[string]int64{"upstream": 2, "client": 6}, HeldShare: map[string]float64{"upstream": 0.25, "client": 0.75}}}
	var out bytes.Buffer
	printStats(&out, stats.Report{Groups: []stats.Group{g}})
	text := out.String()
	i := strings.Index(text, "how streams read:")
	if i < 0 {
		t.Fatalf("no reading table:\n%s", text)
	}
	for _, want := range []string{"QoE p50", "0.612", "12.5%", "812.5", "client 75%"} {
		if !strings.Contains(text[i:], want) {
			t.Errorf("the reading table lacks %q:\n%s", want, text[i:])
		}
	}
	g.Reading = nil
	out.Reset()
	printStats(&out, stats.Report{Groups: []stats.Group{g}})
	if strings.Contains(out.String(), "how streams read") {
		t.Errorf("a reading table without streams:\n%s", out.String())
	}
}
