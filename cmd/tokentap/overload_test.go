package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// TestOverloadEndToEnd runs the program with overload control on a route
// in front of a server of one slot (about 13 requests a second), teaches
// it the server's curve, then offers more than it can serve, and reads
// what a user reads: the 503s with Retry-After, /stats's overload entry
// (limit, prediction, its error, the sheds) and its warning, `tokentap
// stats`, the shed counter on /metrics, the access log's shed records
// with their prediction.
func TestOverloadEndToEnd(t *testing.T) {
	wait.Long(t, "load through the binary at its slot's capacity")
	upstream := startMockllm(t, mockllm.Options{Slots: 1, PrefillBase: 40 * time.Millisecond, TokenGap: 5 * time.Millisecond, MaxTokens: 8})
	route := "overloaded" + strconv.FormatInt(statsRuns.Add(1), 10) // series live for the process
	cfg := filepath.Join(t.TempDir(), "tokentap.yaml")
	conf := "routes:\n  - name: " + route + "\n    prefix: /\n    upstream: " + upstream +
		"\n    slo: {ttft: 150ms}\n    overload: {shed: true, priority_header: X-Priority}\n"
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	listen, admin := freeAddr(t), freeAddr(t)
	logPath := filepath.Join(t.TempDir(), "access.log")
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", logPath})
	defer prog.stop()
	waitUp(t, "http://"+admin+"/healthz")
	// One at a time, then two: the curve below and at the slot.
	postChats(t, listen, 1, 10)
	postChats(t, listen, 2, 10)
	// Then six at once, over and over: a queue no objective survives.
	postChats(t, listen, 6, 15)
	if t.Failed() {
		t.FailNow()
	}
	base := "http://" + admin
	var rep stats.Report
	getJSON(t, base+"/stats?route="+route, &rep)
	if len(rep.Overload) != 1 {
		t.Fatalf("/stats overload: %+v", rep.Overload)
	}
	o := rep.Overload[0]
	t.Logf("overload entry: %+v", o)
	if o.Route != route || !o.Enforcing || !o.Known || o.Shed == 0 || !o.Shedding || o.Limit < 0 || o.Limit > 3 || o.Judged == 0 || o.PredictedTTFTMs <= 0 {
		t.Errorf("overload entry %+v", o)
	}
	warned := false
	for _, w := range rep.Warnings {
		warned = warned || w.Kind == stats.WarnShedding && w.Route == route && strings.Contains(w.Message, "shedding")
	}
	if !warned {
		t.Errorf("no shedding warning in %+v", rep.Warnings)
	}
	var out bytes.Buffer
	if err := runStats(context.Background(), []string{"-admin", admin, "-route", route}, &out); err != nil {
		t.Fatal(err)
	}
	if s := out.String(); !strings.Contains(s, "overload control:") || !strings.Contains(s, "SHEDDING") || !strings.Contains(s, "[shedding]") {
		t.Errorf("tokentap stats:\n%s", s)
	}
	m := regexp.MustCompile(`tokentap_shed_total\{route="` + route + `",upstream="[^"]*",priority="standard"\} (\d+)`).FindStringSubmatch(getText(t, base+"/metrics"))
	if m == nil || m[1] != strconv.FormatInt(o.Shed, 10) {
		t.Errorf("shed counter %v, /stats says %d", m, o.Shed)
	}
	// The access log: each shed a record, outcome shed, with the
	// prediction it was refused on, and priority standard.
	var logged int
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(logPath)
		logged = 0
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, `"outcome":"shed"`) {
				logged++
				if !strings.Contains(line, `"priority":"standard"`) || !regexp.MustCompile(`"predicted_ttft_ms":[1-9]`).MatchString(line) {
					t.Fatalf("shed record: %s", line)
				}
			}
		}
		if int64(logged) >= o.Shed {
			break
		}
	}
	if int64(logged) != o.Shed {
		t.Errorf("%d shed records logged, %d counted", logged, o.Shed)
	}
}

// `tokentap demo -overload` prints both sides: forwarding everything at
// twice the capacity keeps next to nothing good, shedding keeps most of
// the capacity; then the gate's table, shedding.
func TestDemoOverload(t *testing.T) {
	wait.Long(t, "the overload demo's 13 s of load")
	var out bytes.Buffer
	if err := runDemo(context.Background(), []string{"-overload", "-overload-for", "3s"}, &out); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	t.Log(s)
	m := regexp.MustCompile(`goodput\s+([0-9.]+)/s\s+([0-9.]+)/s`).FindStringSubmatch(s)
	if m == nil {
		t.Fatalf("no goodput row:\n%s", s)
	}
	off, _ := strconv.ParseFloat(m[1], 64)
	on, _ := strconv.ParseFloat(m[2], 64)
	if on < 10 || on < 3*off || !strings.Contains(s, "overload control:") {
		t.Errorf("goodput %.1f/s forwarding everything, %.1f/s shedding", off, on)
	}
}
