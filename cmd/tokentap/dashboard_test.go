package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/big"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// browser starts Debian's headless chromium with the flags this closed
// network needs, or skips (fails under CI, which installs it).
func browser(t *testing.T) (context.Context, context.CancelFunc) {
	t.Helper()
	path, err := exec.LookPath("chromium")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("chromium is missing: .ci/run installs Debian's chromium package")
		}
		t.Skip("chromium not installed (Debian: apt-get install chromium)")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true),
		chromedp.WindowSize(1400, 1000))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	return ctx, func() { cancelTimeout(); cancel(); cancelAlloc() }
}

// fmtJS formats a number as the dashboard's fmt does: JavaScript's
// toFixed, which rounds an exact tie (0.625 to 2 places) up, where Go's
// formatting rounds it to even.
func fmtJS(v float64) string {
	d := 2
	switch {
	case v >= 100:
		d = 0
	case v >= 10:
		d = 1
	}
	return toFixed(v, d)
}

// toFixed is JavaScript's Number.prototype.toFixed for v ≥ 0.
func toFixed(v float64, d int) string {
	// An exact tie of the double's exact value (v·10^d computed without
	// rounding): toFixed takes the larger neighbour.
	scale := math.Pow(10, float64(d))
	x := new(big.Float).SetPrec(256).SetFloat64(v)
	x.Mul(x, new(big.Float).SetPrec(256).SetFloat64(scale))
	whole, _ := x.Int(nil)
	if new(big.Float).SetPrec(256).Sub(x, new(big.Float).SetInt(whole)).Cmp(big.NewFloat(0.5)) == 0 {
		v = (float64(whole.Int64()) + 1) / scale
	}
	return strconv.FormatFloat(v, 'f', d, 64)
}

// TestDashboardInBrowser serves the demo's dashboard, opens it in headless
// chromium and checks it: no console error or exception, every chart
// holds data, and the tiles, the warnings and the table show what /stats
// says. With TOKENTAP_SCREENSHOT=FILE it keeps the demo's traffic
// running for TOKENTAP_SCREENSHOT_AFTER (default 0) first and saves a
// screenshot of the page (the README's).
func TestDashboardInBrowser(t *testing.T) {
	wait.Long(t, "headless chromium over the demo")
	ctx, cancel := browser(t)
	defer cancel()
	shot := os.Getenv("TOKENTAP_SCREENSHOT")
	after, _ := time.ParseDuration(os.Getenv("TOKENTAP_SCREENSHOT_AFTER"))
	admin := freeAddr(t)
	live := "0" // numbers that do not move under the test's feet
	if shot != "" {
		live = "6"
	}
	demoCtx, stopDemo := context.WithCancel(context.Background())
	var demoOut strings.Builder
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := runDemo(demoCtx, []string{"-requests", "96", "-concurrency", "8", "-serve", admin, "-live", live}, &demoOut); err != nil {
			t.Error(err)
		}
	}()
	defer func() { stopDemo(); wg.Wait() }()
	waitUpFor(t, "http://"+admin+"/healthz", 30*time.Second)
	if shot == "" {
		// Every request's record is in before the page loads (a record
		// waits for its client's last ACK; a busy machine can hold the
		// last ones past the demo's wait), so the page and the test read
		// the same numbers.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			var all stats.Report
			getJSON(t, "http://"+admin+"/stats?window=all&group_by=route", &all)
			var n int64
			for _, g := range all.Groups {
				n += g.Count
			}
			if n == 96 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d of 96 records after 30 s", n)
			}
		}
	}
	if after > 0 {
		time.Sleep(after)
	}

	var mu sync.Mutex
	var problems []string
	err := chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch e := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			if e.Type == runtime.ConsoleAPICalledTypeError || e.Type == runtime.ConsoleAPICalledTypeWarning {
				var args []string
				for _, a := range e.Args {
					args = append(args, string(a.Value))
				}
				problems = append(problems, fmt.Sprintf("console.%s: %s", e.Type, strings.Join(args, " ")))
			}
		case *runtime.EventExceptionThrown:
			problems = append(problems, fmt.Sprintf("exception: %s %v", e.ExceptionDetails.Text, e.ExceptionDetails.Exception))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	type tiles struct {
		Route, TTFT, ITL, E2E, Goodput, Queue, Overhead, Count, ClientTTFT, Split string
	}
	if _, err := chromedp.Run(ctx, chromedp.Navigate("http://"+admin+"/")); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`window.tokentap && window.tokentap.renders >= 1`, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		mu.Lock()
		defer mu.Unlock()
		t.Fatalf("%v (browser console: %v)", err, problems)
	}
	if shot != "" {
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(shot, png, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot: %s (%d bytes)", shot, len(png))
		return // the numbers moved on with the traffic
	}
	// Points drawn per chart: its first measure, closed slots and the open
	// one's dashed copy together.
	chartPoints, err := chromedp.Run(ctx, chromedp.Evaluate[[]int](`Object.values(window.tokentap.charts).map(c => {
		const k = (c.data.length - 1) / 2;
		return c.data[1].filter(v => v !== null).length + c.data[1 + k].filter(v => v !== null).length;
	})`))
	if err != nil {
		t.Fatal(err)
	}
	// The open slot is drawn apart (its rates run low while requests are in
	// flight): no solid series reaches it, each dashed copy holds it.
	openApart, err := chromedp.Run(ctx, chromedp.Evaluate[[]bool](`Object.values(window.tokentap.charts).map(c => {
		const k = (c.data.length - 1) / 2, n = c.data[0].length;
		let ok = true;
		for (let i = 1; i <= k; i++) ok = ok && c.data[i][n - 1] === null && c.data[i + k].slice(0, Math.max(n - 2, 0)).every(v => v === null);
		return ok && window.tokentap.timeline.routes.every(r => r.points[r.points.length - 1].partial === true);
	})`))
	if err != nil {
		t.Fatal(err)
	}
	goodputAxis, err := chromedp.Run(ctx, chromedp.Evaluate[[][]float64](`Object.values(window.tokentap.charts).filter(c => c.scales["%"]).map(c => [c.scales["%"].min, c.scales["%"].max])`))
	if err != nil {
		t.Fatal(err)
	}
	// How the charts read: TTFT and E2E on axes of their own; times and
	// rates from 0 (a 0.04 ms wiggle on 228 ms is not a swing); legends
	// with names and no "--"; room between the time labels.
	type look struct {
		TTFTScales, E2EScales []string
		Lows                  []float64
		Legend                string
		XSpace                float64
	}
	looks, err := chromedp.Run(ctx, chromedp.Evaluate[[]look](`Object.entries(window.tokentap.charts).map(([id, c]) => {
		const scales = (re) => c.series.filter(s => s.label && re.test(s.label)).map(s => s.scale);
		const lows = Object.entries(c.scales).filter(([k, s]) => k !== "x" && k !== "%" && s.min !== null && s.min !== undefined).map(([, s]) => s.min);
		return {TTFTScales: id.endsWith("/latency") ? scales(/^TTFT/) : [], E2EScales: id.endsWith("/latency") ? scales(/^E2E/) : [],
			Lows: lows, Legend: c.root.querySelector('.u-legend') ? c.root.querySelector('.u-legend').textContent : "", XSpace: typeof c.axes[0].space === "function" ? c.axes[0].space(c, 0, 0, 1, 420) : c.axes[0].space};
	})`))
	if err != nil {
		t.Fatal(err)
	}
	for i, l := range looks {
		if len(l.TTFTScales) > 0 && (slices.Contains(l.TTFTScales, l.E2EScales[0]) || len(l.E2EScales) == 0) {
			t.Errorf("chart %d: TTFT on %v and E2E on %v share an axis", i, l.TTFTScales, l.E2EScales)
		}
		for _, lo := range l.Lows {
			if lo != 0 {
				t.Errorf("chart %d: an axis starting at %v, not 0", i, lo)
			}
		}
		if strings.Contains(l.Legend, "--") || l.XSpace < 80 {
			t.Errorf("chart %d: legend %q, %v px between time labels", i, l.Legend, l.XSpace)
		}
	}
	windows, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll('#window option')).map(o => o.value)`))
	if err != nil {
		t.Fatal(err)
	}
	shown, err := chromedp.Run(ctx, chromedp.Evaluate[[]tiles](`Array.from(document.querySelectorAll('.route')).map(r => {
		const f = (n) => r.querySelector('[data-field="' + n + '"]').textContent;
		return {Route: r.dataset.route, TTFT: f('ttft'), ITL: f('itl'), E2E: f('e2e'), Goodput: f('goodput'), Queue: f('queue'), Overhead: f('overhead'), Count: f('count'), ClientTTFT: f('client_ttft'), Split: f('split')};
	})`))
	if err != nil {
		t.Fatal(err)
	}
	// Each route's QoE panel: the tiles and where the tokens were held.
	readings, err := chromedp.Run(ctx, chromedp.Evaluate[map[string][]string](`Object.fromEntries(Array.from(document.querySelectorAll('.route')).map(r => {
		const f = (n) => { const e = r.querySelector('.reading [data-field="' + n + '"]'); return e ? e.textContent : ""; };
		return [r.dataset.route, [f('qoe'), f('fluidity'), f('stalled'), f('held'), String(r.querySelectorAll('.held-bar span').length)]];
	}))`))
	if err != nil {
		t.Fatal(err)
	}
	warnings, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#warnings .warning').length`))
	if err != nil {
		t.Fatal(err)
	}
	rows, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('#groups tbody tr').length`))
	if err != nil {
		t.Fatal(err)
	}
	// The overload table: the demo's chat route predicts (no shedding).
	gates, err := chromedp.Run(ctx, chromedp.Evaluate[[][]string](`document.getElementById('overload').hidden ? [] :
		Array.from(document.querySelectorAll('#overload tbody tr')).map(r => [r.dataset.route, r.cells[2].textContent, r.cells[4].textContent])`))
	if err != nil {
		t.Fatal(err)
	}

	mu.Lock()
	if len(problems) > 0 {
		t.Errorf("browser console: %v", problems)
	}
	mu.Unlock()
	// 4 routes × 3 charts, each with its route's data, and 3 more for the
	// completions route's two upstreams side by side, once both took
	// requests: least_ttft sends the slow one only what the fast one
	// would serve later (and, while it has no prediction, a share), which
	// on a busy machine may be none of the demo's few.
	var byUp stats.Report
	getJSON(t, "http://"+admin+"/stats?window=all&group_by=route,upstream", &byUp)
	want := 12
	for _, g := range byUp.Groups {
		if g.Route == "completions" && g.Upstream == "slow" && g.Count > 0 {
			want = 15
		}
	}
	if len(chartPoints) != want {
		t.Errorf("%d charts, want %d", len(chartPoints), want)
	}
	for i, n := range chartPoints {
		if n == 0 {
			t.Errorf("chart %d holds no data", i)
		}
	}
	for i, ok := range openApart {
		if !ok {
			t.Errorf("chart %d draws the open slot as a closed one", i)
		}
	}
	if len(goodputAxis) != 4 {
		t.Errorf("%d goodput axes, want 4", len(goodputAxis))
	}
	for _, r := range goodputAxis {
		if len(r) != 2 || r[0] != 0 || r[1] != 100 {
			t.Errorf("goodput axis %v, want 0–100%%", r)
		}
	}
	if strings.Join(windows, ",") != strings.Join(stats.Windows, ",") {
		t.Errorf("window selector offers %v, /stats %v", windows, stats.Windows)
	}
	var byRoute, all stats.Report
	getJSON(t, "http://"+admin+"/stats?window=5m&group_by=route", &byRoute)
	getJSON(t, "http://"+admin+"/stats?window=5m", &all)
	// The chat route's gate (predicting) and the completions route's two
	// upstreams (least_ttft), row for row as /stats has them.
	routesShown := map[string]int{}
	for i, g := range gates {
		if i >= len(all.Overload) || g[0] != all.Overload[i].Route || g[1] != "predicting" || all.Overload[i].Known && g[2] == "–" {
			t.Errorf("overload table row %d %v, /stats %+v", i, g, all.Overload)
			break
		}
		routesShown[g[0]]++
	}
	if len(gates) != 3 || len(all.Overload) != 3 || routesShown["chat"] != 1 || routesShown["completions"] != 2 {
		t.Errorf("overload table %v, /stats %+v", gates, all.Overload)
	}
	if len(shown) != len(byRoute.Groups) || len(shown) != 4 {
		t.Fatalf("page shows %d routes, /stats has %d", len(shown), len(byRoute.Groups))
	}
	q := func(d stats.Dist) string {
		if d.Count == 0 {
			return "–" // not measured: never a 0
		}
		return fmtJS(d.P50) + " / " + fmtJS(d.P95) + " / " + fmtJS(d.P99)
	}
	at := func(d stats.Dist, v float64) string {
		if d.Count == 0 {
			return "–"
		}
		return fmtJS(v)
	}
	pct := func(v *float64) string {
		if v == nil {
			return "–"
		}
		return toFixed(100**v, 1) + "%"
	}
	ptr := func(v float64) *float64 { return &v }
	readingShown := 0
	for _, g := range byRoute.Groups {
		var got *tiles
		for i := range shown {
			if shown[i].Route == g.Route {
				got = &shown[i]
			}
		}
		if got == nil {
			t.Errorf("route %s not shown", g.Route)
			continue
		}
		good := pct(g.Goodput.Ratio)
		if g.Goodput.Target != nil {
			good += " (target " + pct(g.Goodput.Target) + ")"
		}
		if g.Goodput.Judged == 0 {
			good = "– (no SLO: set slo: {ttft: 500ms} in the config, or -slo ttft=500ms)"
		}
		want := tiles{Route: g.Route, TTFT: q(g.TTFT), ITL: q(g.ITL), E2E: q(g.E2E), Goodput: good,
			Queue: at(g.Queue, g.Queue.P50) + " / " + at(g.Queue, g.Queue.P95), Overhead: at(g.Overhead, g.Overhead.P50) + " / " + at(g.Overhead, g.Overhead.P95),
			Count: fmt.Sprintf("%d (%d, %d, %d)", g.Count, g.Errors, g.Limited, g.Refused), ClientTTFT: q(g.ClientTTFT),
			Split: fmt.Sprintf("Users waited %s ms for the first token (p50): %s in the network, %s in tokentap, the rest in the queue (%s) and the backend.",
				fmtJS(g.ClientTTFT.P50), fmtJS(max(g.ClientTTFT.P50-g.TTFT.P50, 0)), fmtJS(g.Overhead.P50), fmtJS(g.Queue.P50))}
		if *got != want {
			t.Errorf("route %s shows\n  %+v\n/stats says\n  %+v", g.Route, *got, want)
		}
		wantRd := []string{"QoE: – (no stream with tokens in the window)", "", "", "", "0"}
		if rd := g.Reading; rd != nil {
			held := "where tokens were held: no reader waited"
			if w := rd.HeldBy["upstream"] + rd.HeldBy["gateway"] + rd.HeldBy["client"]; w > 0 {
				held = fmt.Sprintf("where tokens were held: upstream %s · gateway %s · client %s (of %d streams whose reader waited)",
					pct(ptr(rd.HeldShare["upstream"])), pct(ptr(rd.HeldShare["gateway"])), pct(ptr(rd.HeldShare["client"])), w)
			}
			wantRd = []string{toFixed(rd.QoE.P50, 3) + " / " + toFixed(rd.QoE.P95, 3) + " / " + toFixed(rd.QoE.P99, 3),
				toFixed(rd.Fluidity.P50, 3) + " / " + toFixed(rd.Fluidity.P99, 3), fmt.Sprintf("%s of %d", pct(&rd.StallRate), rd.Streams), held, "3"}
			readingShown++
		}
		if got := readings[g.Route]; !slices.Equal(got, wantRd) {
			t.Errorf("route %s's QoE panel shows %q, /stats says %q", g.Route, got, wantRd)
		}
	}
	if readingShown == 0 {
		t.Errorf("no route's streams read: the demo streams, so its QoE panel should draw")
	}
	if warnings != len(all.Warnings) || rows != len(all.Groups) {
		t.Errorf("page: %d warnings, %d table rows; /stats: %d, %d", warnings, rows, len(all.Warnings), len(all.Groups))
	}
}

func waitUpFor(t *testing.T, url string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if status(t, "GET", url, "") == 200 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s not up", url)
}

// TestFmtJS: the test's copy of the page's number format agrees with
// JavaScript's toFixed (values and results printed by node).
func TestFmtJS(t *testing.T) {
	for v, want := range map[float64]string{0.625: "0.63", 0.615: "0.61", 12.25: "12.3", 150.5: "151", 0.125: "0.13", 1.005: "1.00", 99.95: "100.0"} {
		if got := fmtJS(v); got != want {
			t.Errorf("fmtJS(%v) = %s, toFixed gives %s", v, got, want)
		}
	}
	if got := toFixed(99.25, 1); got != "99.3" { // (99.25).toFixed(1)
		t.Errorf("toFixed(99.25, 1) = %s, want 99.3", got)
	}
}

// TestDashboardComparisonInBrowser: a route with a stable upstream and a
// canary 15 times slower to its first token, under a guard. The page
// shows, for that route, each upstream's TTFT, ITL and E2E over time,
// the verdict table as /stats?compare says it (intervals, and "too few"
// rows where a side has too few requests for a quantile), and the guard
// tripped with its reason; its reset button clears it, and the page then
// shows it armed again.
func TestDashboardComparisonInBrowser(t *testing.T) {
	wait.Long(t, "headless chromium over the demo")
	ctx, cancel := browser(t)
	defer cancel()
	stable := startMockllm(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: time.Millisecond})
	canary := startMockllm(t, mockllm.Options{PrefillBase: 150 * time.Millisecond, TokenGap: time.Millisecond})
	route := fmt.Sprintf("cmpview%d", statsRuns.Add(1))
	cfg := writeFile(t, fmt.Sprintf("routes:\n  - name: %s\n    prefix: /\n    upstreams:\n      - {name: stable, url: %q}\n      - {name: canary, url: %q}\n"+
		"    guard: {candidate: canary, baseline: stable, min_requests: 80, max_ttft_p95_increase: 100%%}\n", route, stable, canary))
	listen, admin := freeAddr(t), freeAddr(t)
	prog := startRun(t, []string{"-config", cfg, "-listen", listen, "-admin", admin, "-access-log", ""})
	defer prog.stop()
	base := "http://" + admin
	waitUp(t, base+"/healthz")
	var guards []proxy.GuardState
	for i := 0; ; i++ {
		postChats(t, listen, 8, 5)
		getJSON(t, base+"/guards", &guards)
		if len(guards) == 1 && guards[0].Tripped != nil {
			break
		}
		if i == 30 {
			t.Fatalf("the guard did not trip: %+v", guards)
		}
		time.Sleep(guardLook)
	}
	var problems []string
	var mu sync.Mutex
	if err := chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		if e, ok := ev.(*runtime.EventExceptionThrown); ok {
			problems = append(problems, fmt.Sprintf("exception: %s %v", e.ExceptionDetails.Text, e.ExceptionDetails.Exception))
		}
		if e, ok := ev.(*runtime.EventConsoleAPICalled); ok && (e.Type == runtime.ConsoleAPICalledTypeError || e.Type == runtime.ConsoleAPICalledTypeWarning) {
			problems = append(problems, fmt.Sprintf("console.%s", e.Type))
		}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Navigate(base+"/?window=all")); err != nil {
		t.Fatal(err)
	}
	// The verdict over all requests, read by the page and by the test.
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[any](`document.getElementById('window').value = 'all'; document.getElementById('window').dispatchEvent(new Event('change'))`)); err != nil {
		t.Fatal(err)
	}
	ready := `window.tokentap && window.tokentap.verdicts && window.tokentap.verdicts[` + strconv.Quote(route) + `] && window.tokentap.verdicts[` + strconv.Quote(route) + `].window === 'all' && document.querySelectorAll('.compare .verdict tbody tr').length > 0`
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](ready, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("%v (problems: %v)", err, problems)
	}
	type row struct{ Measure, A, B, Diff, Verdict, Why, Class string }
	rows, err := chromedp.Run(ctx, chromedp.Evaluate[[]row](`Array.from(document.querySelectorAll('.compare .verdict tbody tr')).map(r => {
		const c = r.querySelectorAll('td');
		return {Measure: c[0].textContent, A: c[1].textContent, B: c[2].textContent, Diff: c[3].textContent, Verdict: c[4].textContent, Why: c[5].textContent, Class: r.className};
	})`))
	if err != nil {
		t.Fatal(err)
	}
	shown, err := chromedp.Run(ctx, chromedp.Evaluate[stats.Comparison](`window.tokentap.verdicts[`+strconv.Quote(route)+`]`))
	if err != nil {
		t.Fatal(err)
	}
	upCharts, err := chromedp.Run(ctx, chromedp.Evaluate[[]int](`Object.entries(window.tokentap.charts).filter(([k]) => k.includes('/up-')).map(([, c]) => c.data.length)`))
	if err != nil {
		t.Fatal(err)
	}
	guardText, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('.compare [data-guard]').dataset.guard + ': ' + document.querySelector('.compare [data-guard]').textContent`))
	if err != nil {
		t.Fatal(err)
	}
	// The page's rows are the verdict's, in its order and words.
	var want []row
	pct := func(v float64) string {
		s := toFixed(math.Abs(100*v), 1)
		if v >= 0 {
			return "+" + s + "%"
		}
		return "-" + s + "%"
	}
	wantRow := func(name string, d stats.Diff) {
		r := row{Measure: name, A: fmtJS(d.A), B: fmtJS(d.B), Why: d.Why}
		switch {
		case d.TooFew:
			var need []string
			if d.NeedA > 0 {
				need = append(need, fmt.Sprintf("%d more on %s", d.NeedA, shown.A))
			}
			if d.NeedB > 0 {
				need = append(need, fmt.Sprintf("%d more on %s", d.NeedB, shown.B))
			}
			r.Diff = "too few requests"
			if len(need) > 0 {
				r.Diff += " (needs " + strings.Join(need, " and ") + ")"
			}
		default:
			r.Diff = fmt.Sprintf("%s (%s … %s)", pct(d.RelativeDiff), pct(d.CILow), pct(d.CIHigh))
			r.Verdict = "within noise"
			switch d.Better {
			case "b":
				r.Verdict, r.Class = shown.B+" better", "significant better"
			case "a":
				r.Verdict, r.Class = shown.B+" worse", "significant worse"
			}
			if d.CILow == d.CIHigh {
				t.Errorf("%s %s: an interval of no width", d.Name, d.Quantile)
			}
		}
		if d.TooFew {
			r.Class = "too-few"
		}
		want = append(want, r)
	}
	if shown.Through.Name != "" {
		wantRow("tokens/s per request p50", shown.Through)
	}
	tooFew, significant := 0, false
	for _, d := range shown.Measures {
		wantRow(strings.TrimSuffix(d.Name, "_ms")+" "+d.Quantile, d)
		if d.TooFew {
			tooFew++
		}
		if d.Name == "ttft_ms" && d.Quantile == "p50" && d.Significant && d.RelativeDiff > 1 {
			significant = true
		}
	}
	if fmt.Sprint(rows) != fmt.Sprint(want) {
		t.Errorf("the page's verdict rows\n  %v\nthe verdict's\n  %v", rows, want)
	}
	if shown.A != "stable" || shown.B != "canary" || !significant || tooFew == 0 || !strings.Contains(shown.Sides, "guard") {
		t.Errorf("verdict %s against %s (%s): TTFT p50 found slower %v, %d too-few rows (the p99s want more requests)", shown.B, shown.A, shown.Sides, significant, tooFew)
	}
	// tokentap compare without names takes the same sides and says the
	// same of every row.
	var out strings.Builder
	if err := runCompare(context.Background(), []string{"-admin", strings.TrimPrefix(base, "http://"), "-route", route, "-window", "all", "-json"}, &out); err != nil {
		t.Fatal(err)
	}
	var cli stats.Comparison
	if err := json.Unmarshal([]byte(out.String()), &cli); err != nil {
		t.Fatal(err)
	}
	if cli.A != shown.A || cli.B != shown.B || cli.Sides != shown.Sides || len(cli.Measures) != len(shown.Measures) {
		t.Errorf("tokentap compare: %s against %s (%s), the dashboard: %s against %s (%s)", cli.B, cli.A, cli.Sides, shown.B, shown.A, shown.Sides)
	} else {
		for i, d := range cli.Measures {
			if s := shown.Measures[i]; d.Name != s.Name || d.Quantile != s.Quantile || d.Better != s.Better || d.Significant != s.Significant {
				t.Errorf("row %s %s: the CLI says %q, the dashboard %q", d.Name, d.Quantile, d.Why, s.Why)
			}
		}
	}
	if len(upCharts) != 3 {
		t.Errorf("%d upstream charts, want 3", len(upCharts))
	}
	for _, n := range upCharts {
		if n != 1+2*2 { // time, two upstreams, their open-slot copies
			t.Errorf("an upstream chart has %d columns, want 5", n)
		}
	}
	if !strings.HasPrefix(guardText, "tripped: ") || !strings.Contains(guardText, "TTFT p95") {
		t.Errorf("the guard shows %q", guardText)
	}
	// The reset button clears the guard, and the page shows it armed.
	if _, err := chromedp.Run(ctx, chromedp.Click(`.compare [data-action="reset-guard"]`)); err != nil {
		t.Fatal(err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('.compare [data-guard]').dataset.guard === 'armed'`, chromedp.WithPollingTimeout(30*time.Second))); err != nil {
		t.Fatalf("after the reset: %v", err)
	}
	getJSON(t, base+"/guards", &guards)
	if len(guards) != 1 || guards[0].Tripped != nil || guards[0].Looks != 0 {
		t.Errorf("after the page's reset: %+v", guards)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(problems) > 0 {
		t.Errorf("browser console: %v", problems)
	}
}

// guardLook is how often a guard looks: traffic spaced by it gives it a
// look between batches.
const guardLook = 1100 * time.Millisecond
