package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// progressBar draws a bar on a terminal (and nothing elsewhere).
type progressBar struct {
	mu    sync.Mutex
	total int
	start time.Time
	last  time.Time
	on    bool
}

func newProgress(total int) *progressBar {
	fi, err := os.Stderr.Stat()
	return &progressBar{total: total, start: time.Now(), on: err == nil && fi.Mode()&os.ModeCharDevice != 0}
}

func (p *progressBar) update(done, errs int) {
	if !p.on {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.last) < 100*time.Millisecond && done != p.total {
		return
	}
	p.last = time.Now()
	el := time.Since(p.start).Seconds()
	bar := ""
	if p.total > 0 {
		n := min(30, done*30/p.total)
		bar = "[" + strings.Repeat("#", n) + strings.Repeat(".", 30-n) + "] "
	}
	fmt.Fprintf(os.Stderr, "\r%s%d/%d requests  %.1f req/s  %d errors ", bar, done, p.total, float64(done)/max(el, 1e-9), errs)
}

func (p *progressBar) done() {
	if p.on {
		fmt.Fprintln(os.Stderr)
	}
}

// printSummary writes one run's table.
func printSummary(w io.Writer, s summary) {
	fmt.Fprintf(w, "%d requests (+%d warm-up) in %.1fs, %d errors (%d timeouts)\n", s.Requests, s.Warmup, s.Seconds, s.Errors, s.Timeouts)
	fmt.Fprintf(w, "throughput %.2f req/s, %.1f output tokens/s; goodput %.2f req/s (%.1f%% met the SLO %s)\n\n",
		s.RequestsPerS, s.OutputTokPerS, s.GoodputPerS, 100*s.GoodFraction, sloString(s.SLO))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "metric\tn\tmean\tp50\tp95\tp99\tmax\t")
	row := func(name string, d dist) {
		if d.N == 0 {
			return
		}
		fmt.Fprintf(tw, "%s\t%d\t%.2fms\t%.2fms\t%.2fms\t%.2fms\t%.2fms\t\n", name, d.N, d.Mean, d.P50, d.P95, d.P99, d.Max)
	}
	row("TTFT", s.TTFT)
	row("ITL", s.ITL)
	row("TPOT", s.TPOT)
	row("E2E", s.E2E)
	row("token delay", s.Delay)
	tw.Flush()
	if rd := s.Reading; rd != nil {
		fmt.Fprintf(w, "\nhow %d streams read (client's clock): QoE p50 %.3f, p95/p99 (low) %.3f/%.3f; fluidity p50 %.3f, p99 (low) %.3f; %.1f%% stalled, stall p99 %.1f ms\n",
			rd.Streams, rd.QoE.P50, rd.QoE.P95, rd.QoE.P99, rd.Fluidity.P50, rd.Fluidity.P99, 100*rd.StallRate, rd.StallMS.P99)
	}
	if a := s.Accuracy; a != nil {
		fmt.Fprintf(w, "\ntokentap vs client, %d requests matched by id: |Δ| p50/p99\n", a.Matched)
		fmt.Fprintf(w, "  TTFT %.3f/%.3f ms   E2E %.3f/%.3f ms   ITL mean %.3f/%.3f ms\n", a.TTFT.P50, a.TTFT.P99, a.E2E.P50, a.E2E.P99, a.ITL.P50, a.ITL.P99)
		fmt.Fprintf(w, "  the client saw the longer time for %.0f%% (TTFT) and %.0f%% (E2E) of them\n", 100*a.TTFTClientLonger, 100*a.E2EClientLonger)
		if r := a.Reading; r != nil {
			fmt.Fprintf(w, "  how %d streams read: |Δ| qoe %.3f/%.3f, fluidity %.3f/%.3f, stall %.1f/%.1f ms; stalls agree on %.0f%%\n",
				r.Streams, r.QoE.P50, r.QoE.P99, r.Fluidity.P50, r.Fluidity.P99, r.Stall.P50, r.Stall.P99, 100*r.StallsAgree)
		}
	}
}

func sloString(o slo) string {
	var p []string
	if o.TTFT > 0 {
		p = append(p, "ttft≤"+o.TTFT.String())
	}
	if o.TPOT > 0 {
		p = append(p, "tpot≤"+o.TPOT.String())
	}
	if o.E2E > 0 {
		p = append(p, "e2e≤"+o.E2E.String())
	}
	if len(p) == 0 {
		return "(none: no error)"
	}
	return strings.Join(p, ",")
}
