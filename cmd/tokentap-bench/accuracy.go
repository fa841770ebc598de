package main

import (
	"bufio"
	"encoding/json"
	"math"
	"os"
	"strings"
	"time"

	pmeasure "github.com/tokentap/tokentap/proxy/measure"
)

// accuracy compares, request by request, what tokentap recorded in its
// access log with what the client saw: the absolute differences.
type accuracy struct {
	Matched int  `json:"matched"`
	TTFT    dist `json:"ttft_abs_diff"`
	E2E     dist `json:"e2e_abs_diff"`
	ITL     dist `json:"itl_mean_abs_diff"`
	// The share of requests whose client saw the longer time: where it is
	// near 1, the differences are time outside tokentap (the client's own
	// sending and reading), not time tokentap missed or invented.
	TTFTClientLonger float64 `json:"ttft_client_longer_share"`
	E2EClientLonger  float64 `json:"e2e_client_longer_share"`
	// The same against the client's kernel receive times (when the
	// response's bytes reached the client's machine, not when the client
	// read them): the client's own read lateness taken out.
	TTFTKernel             dist    `json:"ttft_abs_diff_kernel"`
	E2EKernel              dist    `json:"e2e_abs_diff_kernel"`
	TTFTKernelClientLonger float64 `json:"ttft_kernel_client_longer_share"`
	E2EKernelClientLonger  float64 `json:"e2e_kernel_client_longer_share"`
	// Reading compares how each stream read (qoe, fluidity, stall_ms,
	// stalls in the log) with the client's reading at the same pace.
	Reading *readingAccuracy `json:"reading,omitempty"`
}

// diffs gathers |tokentap − client| over matched requests, and how often
// the client's time was the longer.
type diffs struct {
	d      []time.Duration
	longer int
}

func (f *diffs) add(tokentapMs float64, client time.Duration) {
	d := time.Duration(tokentapMs*1e6) - client
	if d < 0 {
		f.longer++
		d = -d
	}
	f.d = append(f.d, d)
}

// result returns the distribution and the client-longer share.
func (f *diffs) result() (dist, float64) {
	if len(f.d) == 0 {
		return newDist(nil), 0
	}
	return newDist(f.d), float64(f.longer) / float64(len(f.d))
}

type logLine struct {
	RequestID string   `json:"request_id"`
	TTFT      *float64 `json:"ttft_ms"`
	E2E       *float64 `json:"e2e_ms"`
	ITLMean   *float64 `json:"itl_mean_ms"`
	QoE       *float64 `json:"qoe"`
	Fluidity  *float64 `json:"fluidity"`
	StallMS   *float64 `json:"stall_ms"`
	Stalls    *int     `json:"stalls"`
}

// compareLog reads a tokentap access log and matches its lines to results
// by request id (the client sends X-Request-Id); streams are read at pace
// p on the client's side (the route's, for figures that agree).
func compareLog(path, idPrefix string, res []result, p pmeasure.Pace) (*accuracy, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	byID := make(map[string]*result, len(res))
	for i := range res {
		byID[res[i].ID] = &res[i]
	}
	var ttft, e2e, kTTFT, kE2E, itl, stall diffs
	var qoe, flu scoreDiffs
	agree := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	acc := &accuracy{}
	for sc.Scan() {
		var l logLine
		if json.Unmarshal(sc.Bytes(), &l) != nil || !strings.HasPrefix(l.RequestID, idPrefix) {
			continue
		}
		r := byID[l.RequestID]
		if r == nil || r.Err != "" {
			continue
		}
		acc.Matched++
		if l.TTFT != nil && r.TTFT >= 0 {
			ttft.add(*l.TTFT, r.TTFT)
			kTTFT.add(*l.TTFT, r.TTFTKernel)
		}
		if l.E2E != nil {
			e2e.add(*l.E2E, r.E2E)
			kE2E.add(*l.E2E, r.E2EKernel)
		}
		if g := r.ITL(); l.ITLMean != nil && len(g) > 0 {
			var sum time.Duration
			for _, x := range g {
				sum += x
			}
			itl.add(*l.ITLMean, sum/time.Duration(len(g)))
		}
		if l.QoE != nil && l.Fluidity != nil && l.StallMS != nil && l.Stalls != nil && len(r.Tokens) > 0 {
			rd := pmeasure.ReadingOf(r.Tokens, p)
			qoe, flu = append(qoe, math.Abs(*l.QoE-rd.QoE)), append(flu, math.Abs(*l.Fluidity-rd.Fluidity))
			stall.add(*l.StallMS, rd.Stall)
			if *l.Stalls == rd.Stalls {
				agree++
			}
		}
	}
	if len(qoe) > 0 {
		d, _ := stall.result()
		acc.Reading = &readingAccuracy{Streams: len(qoe), QoE: qoe.result(), Fluidity: flu.result(), Stall: d, StallsAgree: float64(agree) / float64(len(qoe))}
	}
	acc.TTFT, acc.TTFTClientLonger = ttft.result()
	acc.E2E, acc.E2EClientLonger = e2e.result()
	acc.TTFTKernel, acc.TTFTKernelClientLonger = kTTFT.result()
	acc.E2EKernel, acc.E2EKernelClientLonger = kE2E.result()
	acc.ITL, _ = itl.result()
	return acc, sc.Err()
}
