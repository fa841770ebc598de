// The overload bench: goodput (requests a second that met their SLO, at
// the client) against offered load from below to far past a backend's
// capacity, open loop, tokentap's overload control off and on.

package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// overloadSettings are the bench's flags.
type overloadSettings struct {
	outDir, bin, upstream, model string
	capacity                     float64
	capConc, maxTokens           int
	loads                        []float64
	warm, dur                    time.Duration
	slo                          slo
}

// overloadPoint is one offered load with overload control off or on, as
// the client lived it, over the measured part (arrivals after the warm-up).
type overloadPoint struct {
	Load        float64 `json:"load"`
	Shedding    bool    `json:"shedding"`
	OfferedPerS float64 `json:"offered_per_s"`
	Sent        int     `json:"sent"`
	Good        int     `json:"good"`
	Shed        int     `json:"shed"`
	Errors      int     `json:"errors"`
	GoodputPerS float64 `json:"goodput_per_s"`
	// TTFT of the requests served; the time a shed took to be answered.
	TTFT       dist `json:"ttft"`
	ShedAnswer dist `json:"shed_answer"`
	// What tokentap's gate said at the end (its /stats overload entry).
	Limit    int     `json:"limit"`
	AbsError float64 `json:"prediction_abs_error"`
	Bias     float64 `json:"prediction_bias"`
}

// overloadReport is the bench's results.json.
type overloadReport struct {
	Date             time.Time       `json:"date"`
	Backend          string          `json:"backend"`
	CapacityPerS     float64         `json:"capacity_per_s"`
	CapacityMeasured bool            `json:"capacity_measured"`
	SLO              slo             `json:"slo"`
	WarmS            float64         `json:"warm_s"`
	MeasuredS        float64         `json:"measured_s"`
	MaxTokens        int             `json:"max_tokens"`
	Points           []overloadPoint `json:"points"`
}

// simulatedOverloadBackend is the simulated server's flags: 8 slots, the
// others waiting in order, 40 ms of prefill and token gaps of 10 ms alone
// that grow 3% a request in the batch; 20 tokens a request hold a slot
// about 280 ms, so it serves about 28 requests a second.
var simulatedOverloadBackend = []string{"-slots", "8", "-prefill", "40ms", "-prefill-per-token", "1us", "-token-gap", "10ms",
	"-jitter", "0.1", "-batch-slowdown", "0.03"}

func runOverload(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench overload", flag.ContinueOnError)
	var o overloadSettings
	fs.StringVar(&o.outDir, "out", "bench-overload", "directory for results.json, results.md, overload.svg and the processes' logs")
	fs.StringVar(&o.bin, "bin", "", "directory holding the tokentap and mockllm binaries (built there when empty)")
	fs.StringVar(&o.upstream, "upstream", "", "the backend's base URL (e.g. llama.cpp's server, http://127.0.0.1:8077); empty: the simulated server of 8 slots")
	fs.StringVar(&o.model, "model", "mock-llm", "model to ask for")
	fs.Float64Var(&o.capacity, "capacity", 0, "the backend's capacity in requests a second (0: measured first, closed loop at -capacity-concurrency)")
	fs.IntVar(&o.capConc, "capacity-concurrency", 32, "requests in flight while measuring the capacity (well past the backend's batch)")
	fs.IntVar(&o.maxTokens, "max-tokens", 20, "output tokens a request asks for")
	loads := fs.String("loads", "0.5,0.7,0.85,1,1.5,2,3", "offered loads, in times the capacity")
	fs.DurationVar(&o.warm, "warm", 5*time.Second, "time offered before the measured part at each load (the gate learns; arrivals in it are not counted)")
	fs.DurationVar(&o.dur, "duration", 20*time.Second, "measured time at each load")
	sloSpec := fs.String("slo", "ttft=300ms,tpot=30ms", "the objectives tokentap judges and sheds by, and goodput counts")
	render := fs.Bool("render", false, "only rewrite results.md and overload.svg of -out from its results.json")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *render {
		var rep overloadReport
		b, err := os.ReadFile(filepath.Join(o.outDir, "results.json"))
		if err == nil {
			err = json.Unmarshal(b, &rep)
		}
		if err != nil {
			return err
		}
		return writeOverload(o.outDir, &rep, out)
	}
	var err error
	if o.slo, err = parseSLO(*sloSpec); err != nil {
		return err
	}
	if o.slo.TTFT <= 0 && o.slo.TPOT <= 0 {
		return fmt.Errorf("-slo: overload control sheds by ttft or tpot: give one")
	}
	for _, s := range strings.Split(*loads, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
		if err != nil || v <= 0 {
			return fmt.Errorf("-loads: %q is not a positive multiple of the capacity", s)
		}
		o.loads = append(o.loads, v)
	}
	if o.warm < 0 || o.dur <= 0 || o.maxTokens < 1 || o.capConc < 1 {
		return fmt.Errorf("need -warm ≥ 0, -duration > 0, -max-tokens ≥ 1 and -capacity-concurrency ≥ 1")
	}
	if err := os.MkdirAll(o.outDir, 0o755); err != nil {
		return err
	}
	raiseFileLimit()
	b := benchSettings{outDir: o.outDir, bin: o.bin}
	if err := b.buildBinaries(); err != nil {
		return err
	}
	o.bin = b.bin
	rep, err := o.run(out)
	if err != nil {
		return err
	}
	return writeOverload(o.outDir, rep, out)
}

func (o *overloadSettings) run(out io.Writer) (*overloadReport, error) {
	rep := &overloadReport{Date: time.Now().UTC(), SLO: o.slo, WarmS: o.warm.Seconds(), MeasuredS: o.dur.Seconds(), MaxTokens: o.maxTokens}
	upstream := o.upstream
	if upstream == "" {
		addr := freePort()
		mock, err := startProc(o.outDir, "mockllm", filepath.Join(o.bin, "mockllm"), nil, append([]string{"-listen", addr}, simulatedOverloadBackend...)...)
		if err != nil {
			return nil, err
		}
		defer stop(mock)
		upstream = "http://" + addr
		rep.Backend = "simulated: mockllm " + strings.Join(simulatedOverloadBackend, " ")
	} else {
		rep.Backend = upstream
	}
	if err := waitReady(upstream + "/v1/chat/completions"); err != nil {
		return nil, fmt.Errorf("the backend: %w", err)
	}
	w := workload{Name: "overload", PromptBytes: 400, MaxTokens: o.maxTokens}
	rep.CapacityPerS = o.capacity
	if o.capacity == 0 {
		// Closed loop far past the batch: the backend busy all the time,
		// its completions a second its capacity.
		fmt.Fprintf(out, "measuring the backend's capacity: %d requests in flight for %v...\n", o.capConc, o.dur)
		res, wall, err := run(plan{URL: upstream + "/v1/chat/completions", Model: o.model, Workloads: []workload{w}, Stream: true,
			Concurrency: o.capConc, Duration: o.dur, Timeout: 5 * time.Minute, Warmup: o.capConc})
		if err != nil {
			return nil, err
		}
		done := 0
		for i := range res {
			if res[i].Err == "" && res[i].Status == 200 {
				done++
			}
		}
		rep.CapacityPerS, rep.CapacityMeasured = float64(done)/wall.Seconds(), true
		if rep.CapacityPerS <= 0 {
			return nil, fmt.Errorf("the backend served nothing while its capacity was measured")
		}
	}
	fmt.Fprintf(out, "capacity %.1f requests/s; SLO TTFT %v, TPOT %v\n", rep.CapacityPerS, o.slo.TTFT, o.slo.TPOT)
	for _, load := range o.loads {
		for _, shedding := range []bool{false, true} {
			pt, err := o.point(upstream, w, load, rep.CapacityPerS, shedding)
			if err != nil {
				return nil, err
			}
			fmt.Fprintf(out, "%.2fx (%.1f/s) shedding %-5v: %d sent, %d good (%.1f/s), %d shed, %d errors; TTFT p50 %.0f p99 %.0f ms; sheds answered p99 %.1f ms\n",
				load, pt.OfferedPerS, shedding, pt.Sent, pt.Good, pt.GoodputPerS, pt.Shed, pt.Errors, pt.TTFT.P50, pt.TTFT.P99, pt.ShedAnswer.P99)
			rep.Points = append(rep.Points, pt)
		}
	}
	return rep, nil
}

// point runs one offered load through a tokentap of its own, overload
// control shedding or only predicting, and reads what the gate learned.
func (o *overloadSettings) point(upstream string, w workload, load, capacity float64, shedding bool) (overloadPoint, error) {
	pt := overloadPoint{Load: load, Shedding: shedding, OfferedPerS: load * capacity, Limit: -1}
	addr, admin := freePort(), freePort()
	cfg := fmt.Sprintf("listen: %q\nadmin: %q\nslo:\n", addr, admin)
	if o.slo.TTFT > 0 {
		cfg += fmt.Sprintf("  ttft: %v\n", o.slo.TTFT)
	}
	if o.slo.TPOT > 0 {
		cfg += fmt.Sprintf("  tpot: %v\n", o.slo.TPOT)
	}
	cfg += fmt.Sprintf("routes:\n  - name: chat\n    prefix: /\n    upstream: %s\n    overload: {shed: %v}\n", upstream, shedding)
	name := fmt.Sprintf("tokentap-%gx-shed-%v", load, shedding)
	path := filepath.Join(o.outDir, name+".yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o644); err != nil {
		return pt, err
	}
	tt, err := startProc(o.outDir, name, filepath.Join(o.bin, "tokentap"), nil, "-config", path)
	if err != nil {
		return pt, err
	}
	defer stop(tt)
	url := "http://" + addr + "/v1/chat/completions"
	if err := waitReady(url); err != nil {
		return pt, fmt.Errorf("%s: %w", name, err)
	}
	start := time.Now()
	res, _, err := run(plan{URL: url, Model: o.model, Workloads: []workload{w}, Stream: true, Rate: pt.OfferedPerS,
		Duration: o.warm + o.dur, Timeout: 5 * time.Minute})
	if err != nil {
		return pt, err
	}
	from := start.Add(o.warm)
	var ttft, answers []time.Duration
	for i := range res {
		r := &res[i]
		if r.Start.Before(from) {
			continue
		}
		pt.Sent++
		switch {
		case r.Status == 503 || r.Status == 529:
			pt.Shed++
			answers = append(answers, r.E2E)
		case r.Err != "" || r.Status != 200:
			pt.Errors++
		default:
			if r.TTFT >= 0 {
				ttft = append(ttft, r.TTFT)
			}
			if o.slo.met(r) {
				pt.Good++
			}
		}
	}
	pt.GoodputPerS = float64(pt.Good) / o.dur.Seconds()
	pt.TTFT, pt.ShedAnswer = newDist(ttft), newDist(answers)
	// What the gate learned, from /stats.
	if resp, err := http.Get("http://" + admin + "/stats?window=1m"); err == nil {
		var st struct {
			Overload []struct {
				Limit    int     `json:"limit"`
				AbsError float64 `json:"abs_error"`
				Bias     float64 `json:"bias"`
			} `json:"overload"`
		}
		if json.NewDecoder(resp.Body).Decode(&st) == nil && len(st.Overload) > 0 {
			pt.Limit, pt.AbsError, pt.Bias = st.Overload[0].Limit, st.Overload[0].AbsError, st.Overload[0].Bias
		}
		resp.Body.Close()
	}
	return pt, nil
}

// writeOverload writes results.json, results.md and overload.svg.
func writeOverload(dir string, rep *overloadReport, out io.Writer) error {
	b, _ := json.MarshalIndent(rep, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(overloadMarkdown(rep)), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "overload.svg"), []byte(overloadSVG(rep)), 0o644); err != nil {
		return err
	}
	fmt.Fprintf(out, "wrote %s/results.json, results.md and overload.svg\n", dir)
	return nil
}

func overloadMarkdown(rep *overloadReport) string {
	var b strings.Builder
	how := "given"
	if rep.CapacityMeasured {
		how = "measured, closed loop"
	}
	fmt.Fprintf(&b, "# Overload: goodput against offered load\n\n%s. Backend: %s; capacity %.1f requests/s (%s). SLO: TTFT %v, TPOT %v. "+
		"Open loop (Poisson arrivals), %d output tokens a request; at each load %.0f s of warm-up, then %.0f s measured (arrivals in it counted). "+
		"Goodput: requests a second served within both objectives at the client; a shed request is not good.\n\n",
		rep.Date.Format("2006-01-02"), rep.Backend, rep.CapacityPerS, how, rep.SLO.TTFT, rep.SLO.TPOT, rep.MaxTokens, rep.WarmS, rep.MeasuredS)
	b.WriteString("| load | offered/s | shedding | sent | good/s | good % | shed | errors | TTFT p50 ms | TTFT p99 ms | shed answered p50 / p99 ms | learned limit | prediction error |\n")
	b.WriteString("|---:|---:|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, p := range rep.Points {
		on, limit, perr, answered := "off", "-", "-", "-"
		if p.Shedding {
			on = "on"
		}
		if p.Limit >= 0 {
			limit = strconv.Itoa(p.Limit)
			perr = fmt.Sprintf("%.0f%% (bias %+.0f%%)", 100*p.AbsError, 100*p.Bias)
		}
		if p.ShedAnswer.N > 0 {
			answered = fmt.Sprintf("%.1f / %.1f", p.ShedAnswer.P50, p.ShedAnswer.P99)
		}
		fmt.Fprintf(&b, "| %.2fx | %.1f | %s | %d | %.1f | %.0f%% | %d | %d | %.0f | %.0f | %s | %s | %s |\n", p.Load, p.OfferedPerS, on, p.Sent,
			p.GoodputPerS, 100*float64(p.Good)/max(float64(p.Sent), 1), p.Shed, p.Errors, p.TTFT.P50, p.TTFT.P99, answered, limit, perr)
	}
	b.WriteString("\n![goodput against offered load](overload.svg)\n")
	return b.String()
}

// overloadSVG plots goodput against offered load, overload control off
// and on, with the capacity as a line.
func overloadSVG(rep *overloadReport) string {
	const W, H, pad = 760, 380, 60
	loads := []float64{}
	top := rep.CapacityPerS * 1.15
	for _, p := range rep.Points {
		if !slices.Contains(loads, p.Load) {
			loads = append(loads, p.Load)
		}
		top = max(top, p.GoodputPerS*1.1)
	}
	slices.Sort(loads)
	hi := 1.0
	if len(loads) > 0 {
		hi = max(loads[len(loads)-1], 1)
	}
	px := func(l float64) float64 { return pad + l/hi*(W-2*pad) }
	py := func(v float64) float64 { return H - pad - v/top*(H-2*pad) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", W, H)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", W, H)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-weight="bold">Goodput (requests/s within TTFT %v and TPOT %v) against offered load (times the capacity)</text>`+"\n", pad, rep.SLO.TTFT, rep.SLO.TPOT)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/><line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n",
		pad, H-pad, W-pad, H-pad, pad, pad, pad, H-pad)
	for k := 0; k <= 5; k++ {
		v := top * float64(k) / 5
		fmt.Fprintf(&b, `<text x="%d" y="%.0f" text-anchor="end">%.0f</text><line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#eee"/>`+"\n", pad-5, py(v)+4, v, pad, py(v), W-pad, py(v))
	}
	for _, l := range loads {
		fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">%g</text>`+"\n", px(l), H-pad+18, l)
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="#999" stroke-dasharray="4 3"/><text x="%d" y="%.0f" fill="#666">capacity %.1f/s</text>`+"\n",
		pad, py(rep.CapacityPerS), W-pad, py(rep.CapacityPerS), pad+4, py(rep.CapacityPerS)-4, rep.CapacityPerS)
	for i, side := range []struct {
		shedding bool
		name     string
		color    string
	}{{false, "forward everything", "#7f7f7f"}, {true, "shed by prediction", "#d62728"}} {
		var pts []string
		for _, p := range rep.Points {
			if p.Shedding == side.shedding {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(p.Load), py(p.GoodputPerS)))
				fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>`+"\n", px(p.Load), py(p.GoodputPerS), side.color)
			}
		}
		fmt.Fprintf(&b, `<polyline points="%s" fill="none" stroke="%s" stroke-width="2"/>`+"\n", strings.Join(pts, " "), side.color)
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n", pad+i*180, H-22, side.color, pad+i*180+16, H-12, side.name)
	}
	b.WriteString("</svg>\n")
	return b.String()
}
