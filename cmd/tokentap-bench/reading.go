package main

import (
	"math"
	"slices"
	"time"

	pmeasure "github.com/tokentap/tokentap/proxy/measure"
)

// How the streams read on the client's own clock: the reader model of
// tokentap's records (docs/MEASUREMENT.md, "How the stream read") over
// the arrivals this client read, so that a run checks tokentap's figures
// against the client's.

// paceOf is the pace the streams are read against: the SLO's TTFT and
// TPOT where given, else tokentap's defaults (give the route's own for a
// comparison with its records).
func paceOf(o slo) pmeasure.Pace { return pmeasure.Pace{TTFT: o.TTFT, Read: o.TPOT} }

// score is a distribution of a score whose low values are the bad ones:
// its p95 and p99 are the scores 95 and 99% of the streams reached.
type score struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P95  float64 `json:"p95_low"`
	P99  float64 `json:"p99_low"`
}

func newScore(v []float64) score {
	if len(v) == 0 {
		return score{}
	}
	s := slices.Clone(v)
	slices.Sort(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	at := func(q float64) float64 { return s[int(math.Floor(q*float64(len(s)-1)))] }
	return score{Mean: sum / float64(len(s)), P50: at(0.5), P95: at(0.05), P99: at(0.01)}
}

// readingSummary is how a run's streams read.
type readingSummary struct {
	Streams   int     `json:"streams"`
	StallRate float64 `json:"stall_rate"` // streams with a wait of a pace or more
	QoE       score   `json:"qoe"`
	Fluidity  score   `json:"fluidity"`
	StallMS   dist    `json:"stall"`
}

// summarizeReading reads every successful stream of res at p (nil: none
// streamed).
func summarizeReading(res []result, p pmeasure.Pace) *readingSummary {
	var qoe, flu []float64
	var stall []time.Duration
	stalled := 0
	for i := range res {
		r := &res[i]
		if r.Err != "" || r.Status >= 400 || len(r.Tokens) == 0 {
			continue
		}
		rd := pmeasure.ReadingOf(r.Tokens, p)
		qoe, flu, stall = append(qoe, rd.QoE), append(flu, rd.Fluidity), append(stall, rd.Stall)
		if rd.Stalls > 0 {
			stalled++
		}
	}
	if len(qoe) == 0 {
		return nil
	}
	return &readingSummary{Streams: len(qoe), StallRate: float64(stalled) / float64(len(qoe)),
		QoE: newScore(qoe), Fluidity: newScore(flu), StallMS: newDist(stall)}
}

// scoreDiffs gathers |tokentap − client| of a score over matched streams.
type scoreDiffs []float64

// absDiff is the p50 and p99 of the absolute differences.
type absDiff struct {
	P50 float64 `json:"p50"`
	P99 float64 `json:"p99"`
}

func (f scoreDiffs) result() absDiff {
	if len(f) == 0 {
		return absDiff{}
	}
	s := slices.Clone(f)
	slices.Sort(s)
	at := func(q float64) float64 { return s[int(math.Floor(q*float64(len(s)-1)))] }
	return absDiff{P50: at(0.5), P99: at(0.99)}
}

// readingAccuracy is how far tokentap's reading of each stream was from
// the client's: the scores' absolute differences, the stall's, and the
// share of streams whose count of stalls agreed.
type readingAccuracy struct {
	Streams     int     `json:"streams"`
	QoE         absDiff `json:"qoe_abs_diff"`
	Fluidity    absDiff `json:"fluidity_abs_diff"`
	Stall       dist    `json:"stall_abs_diff"`
	StallsAgree float64 `json:"stalls_agree_share"`
}
