package main

import (
	"bufio"
	"encoding/json"
	"os"
	"strings"
	"time"
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
}

type logLine struct {
	RequestID string   `json:"request_id"`
	TTFT      *float64 `json:"ttft_ms"`
	E2E       *float64 `json:"e2e_ms"`
	ITLMean   *float64 `json:"itl_mean_ms"`
}

// compareLog reads a tokentap access log and matches its lines to results
// by request id (the client sends X-Request-Id).
func compareLog(path, idPrefix string, res []result) (*accuracy, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	byID := make(map[string]*result, len(res))
	for i := range res {
		byID[res[i].ID] = &res[i]
	}
	var dTTFT, dE2E, dITL []time.Duration
	var longerTTFT, longerE2E int
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
		abs := func(tokentapMs float64, client time.Duration) time.Duration {
			d := time.Duration(tokentapMs*1e6) - client
			if d < 0 {
				d = -d
			}
			return d
		}
		if l.TTFT != nil && r.TTFT >= 0 {
			dTTFT = append(dTTFT, abs(*l.TTFT, r.TTFT))
			if r.TTFT > time.Duration(*l.TTFT*1e6) {
				longerTTFT++
			}
		}
		if l.E2E != nil {
			dE2E = append(dE2E, abs(*l.E2E, r.E2E))
			if r.E2E > time.Duration(*l.E2E*1e6) {
				longerE2E++
			}
		}
		if g := r.ITL(); l.ITLMean != nil && len(g) > 0 {
			var sum time.Duration
			for _, x := range g {
				sum += x
			}
			dITL = append(dITL, abs(*l.ITLMean, sum/time.Duration(len(g))))
		}
	}
	acc.TTFT, acc.E2E, acc.ITL = newDist(dTTFT), newDist(dE2E), newDist(dITL)
	if len(dTTFT) > 0 {
		acc.TTFTClientLonger = float64(longerTTFT) / float64(len(dTTFT))
	}
	if len(dE2E) > 0 {
		acc.E2EClientLonger = float64(longerE2E) / float64(len(dE2E))
	}
	return acc, sc.Err()
}
