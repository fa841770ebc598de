package main

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// dist is a distribution in milliseconds.
type dist struct {
	N    int     `json:"n"`
	Mean float64 `json:"mean_ms"`
	P50  float64 `json:"p50_ms"`
	P95  float64 `json:"p95_ms"`
	P99  float64 `json:"p99_ms"`
	Max  float64 `json:"max_ms"`
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// newDist summarizes durations (nearest-rank percentiles).
func newDist(d []time.Duration) dist {
	if len(d) == 0 {
		return dist{}
	}
	s := slices.Clone(d)
	slices.Sort(s)
	var sum time.Duration
	for _, x := range s {
		sum += x
	}
	at := func(p float64) float64 {
		i := int(float64(len(s))*p+0.9999999) - 1
		return ms(s[max(0, min(i, len(s)-1))])
	}
	return dist{N: len(s), Mean: ms(sum / time.Duration(len(s))), P50: at(0.50), P95: at(0.95), P99: at(0.99), Max: ms(s[len(s)-1])}
}

// slo holds latency targets; zero fields are not checked.
type slo struct {
	TTFT time.Duration `json:"ttft_ms,omitempty"`
	TPOT time.Duration `json:"tpot_ms,omitempty"`
	E2E  time.Duration `json:"e2e_ms,omitempty"`
}

func parseSLO(s string) (slo, error) {
	var o slo
	if s == "" {
		return o, nil
	}
	for _, part := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(part, "=")
		d, err := time.ParseDuration(strings.TrimSpace(v))
		if !ok || err != nil || d <= 0 {
			return o, fmt.Errorf("-slo: %q is not name=duration (ttft=500ms,tpot=50ms,e2e=10s)", part)
		}
		switch strings.TrimSpace(k) {
		case "ttft":
			o.TTFT = d
		case "tpot":
			o.TPOT = d
		case "e2e":
			o.E2E = d
		default:
			return o, fmt.Errorf("-slo: unknown target %q (ttft, tpot, e2e)", k)
		}
	}
	return o, nil
}

func (o slo) met(r *result) bool {
	if r.Err != "" || r.Status >= 400 {
		return false
	}
	if o.TTFT > 0 && (r.TTFT < 0 || r.TTFT > o.TTFT) {
		return false
	}
	if o.TPOT > 0 && r.TPOT() > o.TPOT {
		return false
	}
	return o.E2E == 0 || r.E2E <= o.E2E
}

// summary is one run's figures, as printed and written to JSON.
type summary struct {
	Name          string    `json:"name,omitempty"`
	Requests      int       `json:"requests"`
	Warmup        int       `json:"warmup"`
	Errors        int       `json:"errors"`
	Timeouts      int       `json:"timeouts"`
	Seconds       float64   `json:"seconds"`
	RequestsPerS  float64   `json:"requests_per_s"`
	OutputTokPerS float64   `json:"output_tokens_per_s"`
	GoodputPerS   float64   `json:"goodput_per_s"`
	GoodFraction  float64   `json:"good_fraction"`
	SLO           slo       `json:"slo"`
	TTFT          dist      `json:"ttft"`
	ITL           dist      `json:"itl"`
	TPOT          dist      `json:"tpot"`
	E2E           dist      `json:"e2e"`
	Delay         dist      `json:"token_delivery_delay,omitempty"`
	Accuracy      *accuracy `json:"accuracy,omitempty"`
	// Reading is how the streams read on the client's clock, at the SLO's
	// TTFT and TPOT (else tokentap's default pace).
	Reading *readingSummary `json:"reading,omitempty"`
	// Samples are the per-request figures (at most maxSamples of each),
	// for confidence intervals in compare.
	Samples *samples `json:"samples,omitempty"`
}

// samples are a run's raw figures, in milliseconds (tokens/s for
// TokensPerS: each request's output tokens over its E2E): of each kind, a
// uniform random sample of at most maxSamples (seeded: the same run keeps
// the same sample), so that a run longer than that is represented whole,
// not by its start. The gaps between tokens are kept by request
// (ITLByRequest): one request's gaps are not independent of each other,
// and compare resamples them by request. ITL is the flat form files
// written before kept.
type samples struct {
	TTFT         []float64   `json:"ttft_ms"`
	E2E          []float64   `json:"e2e_ms"`
	ITL          []float64   `json:"itl_ms,omitempty"`
	ITLByRequest [][]float64 `json:"itl_ms_by_request,omitempty"`
	TokensPerS   []float64   `json:"tokens_per_s"`
}

// maxSamples bounds each kind of sample kept in a result file (for the
// gaps: all the gaps of the requests kept).
const maxSamples = 20000

// sampleSeed seeds the choice of samples.
const sampleSeed = 20261205

// msRounded is v in milliseconds to the microsecond, as result files keep it.
func msRounded(v time.Duration) float64 { return math.Round(float64(v.Microseconds())) / 1000 }

// msSamples is a uniform random sample of at most maxSamples of d, in ms.
func msSamples(d []time.Duration, rng *rand.Rand) []float64 {
	out := make([]float64, 0, min(len(d), maxSamples))
	for _, i := range rng.Perm(len(d)) {
		if len(out) == maxSamples {
			break
		}
		out = append(out, msRounded(d[i]))
	}
	return out
}

// gapSamples keeps the gaps of requests drawn uniformly at random, whole,
// until the next would pass maxSamples gaps in all.
func gapSamples(byRequest [][]time.Duration, rng *rand.Rand) [][]float64 {
	var out [][]float64
	n := 0
	for _, i := range rng.Perm(len(byRequest)) {
		g := byRequest[i]
		if len(g) == 0 {
			continue
		}
		if n+len(g) > maxSamples {
			break
		}
		row := make([]float64, len(g))
		for k, v := range g {
			row[k] = msRounded(v)
		}
		out, n = append(out, row), n+len(g)
	}
	return out
}

func summarize(name string, res []result, wall time.Duration, warmup int, o slo) summary {
	s := summary{Name: name, Requests: len(res), Warmup: warmup, Seconds: wall.Seconds(), SLO: o}
	var ttft, itl, tpot, e2e, delay []time.Duration
	var itlByRequest [][]time.Duration
	tokens, good := 0, 0
	for i := range res {
		r := &res[i]
		if r.Err != "" || r.Status >= 400 {
			s.Errors++
			if r.Timeout {
				s.Timeouts++
			}
			continue
		}
		if r.TTFT >= 0 {
			ttft = append(ttft, r.TTFT)
		}
		gaps := r.ITL()
		itl = append(itl, gaps...)
		itlByRequest = append(itlByRequest, gaps)
		if t := r.TPOT(); t >= 0 {
			tpot = append(tpot, t)
		}
		e2e = append(e2e, r.E2E)
		delay = append(delay, r.Delays...)
		tokens += r.Output
		if o.met(r) {
			good++
		}
	}
	if wall > 0 {
		s.RequestsPerS = float64(len(res)-s.Errors) / wall.Seconds()
		s.OutputTokPerS = float64(tokens) / wall.Seconds()
		s.GoodputPerS = float64(good) / wall.Seconds()
	}
	if len(res) > 0 {
		s.GoodFraction = float64(good) / float64(len(res))
	}
	s.TTFT, s.ITL, s.TPOT, s.E2E, s.Delay = newDist(ttft), newDist(itl), newDist(tpot), newDist(e2e), newDist(delay)
	s.Reading = summarizeReading(res, paceOf(o))
	rng := rand.New(rand.NewPCG(sampleSeed, uint64(len(res))))
	s.Samples = &samples{TTFT: msSamples(ttft, rng), E2E: msSamples(e2e, rng), ITLByRequest: gapSamples(itlByRequest, rng)}
	var perS []float64
	for i := range res {
		if r := &res[i]; r.Err == "" && r.Status < 400 && r.E2E > 0 && r.Output > 0 {
			perS = append(perS, float64(r.Output)/r.E2E.Seconds())
		}
	}
	for _, i := range rng.Perm(len(perS)) {
		if len(s.Samples.TokensPerS) == maxSamples {
			break
		}
		s.Samples.TokensPerS = append(s.Samples.TokensPerS, perS[i])
	}
	return s
}
