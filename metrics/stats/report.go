package stats

import (
	"math"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// Report is the /stats answer. Its JSON form is a stable schema
// (docs/STATS.md): fields are added, never renamed or removed.
type Report struct {
	// Window is the window asked for; WindowS the seconds it covers now
	// (less than its length in the first minutes, and rounded to its
	// steps: 10 s for 1m, a minute for 5m, five minutes for 1h).
	Window      string    `json:"window"`
	WindowS     float64   `json:"window_s"`
	GeneratedAt time.Time `json:"generated_at"`
	Groups      []Group   `json:"groups"`
	Warnings    []Warning `json:"warnings"`
	// Guards are the canary guards tripped now (set by the admin
	// listener, which knows the routes).
	Guards []TrippedGuard `json:"guards"`
	// Overload is each overload-controlled route's upstreams, as their
	// gates see them now (set by the admin listener).
	Overload []Overload `json:"overload,omitempty"`
}

// Group is one route × model × tenant × upstream over the window.
type Group struct {
	Route    string `json:"route"`
	Model    string `json:"model"`
	Tenant   string `json:"tenant"`
	Upstream string `json:"upstream"`
	// Class is the requests' class, in a table grouped by class.
	Class string `json:"class,omitempty"`
	// Shadow: the copies sent to the route's shadow upstream (never in
	// the route's or a tenant's groups).
	Shadow bool `json:"shadow,omitempty"`
	// Count is the requests that finished in the window; Errors those
	// the service failed (upstream_error, upstream_timeout, rejected,
	// shutdown); Limited those refused for their client's own limits (an
	// unknown key, the tenant's limits), which are not judged against the
	// SLO.
	Count   int64 `json:"count"`
	Errors  int64 `json:"errors"`
	Limited int64 `json:"limited"`
	// Refused is the requests tokentap answered itself, never sent
	// upstream (shed, limited, rejected, malformed): counted here and in
	// Count, and timed in no distribution, which hold the requests served.
	Refused          int64   `json:"refused"`
	RequestsPerS     float64 `json:"requests_per_s"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	Goodput          Goodput `json:"goodput"`
	// CostUSD is what the window's priced requests cost (prices), with
	// Priced of them priced; CostPerGoodUSD the cost over the requests
	// that met their objectives (absent without both). CacheHitShare is
	// the share of requests whose backend reported cached input tokens,
	// of CacheReported that reported.
	CostUSD        float64  `json:"cost_usd"`
	Priced         int64    `json:"priced"`
	CostPerGoodUSD *float64 `json:"cost_per_good_usd,omitempty"`
	CacheReported  int64    `json:"cache_reported"`
	CacheHitShare  *float64 `json:"cache_hit_share,omitempty"`
	TTFT           Dist     `json:"ttft_ms"`
	TTFA           Dist     `json:"ttfa_ms"`
	ITL            Dist     `json:"itl_ms"`
	TPOT           Dist     `json:"tpot_ms"`
	E2E            Dist     `json:"e2e_ms"`
	Queue          Dist     `json:"queue_ms"`
	Overhead       Dist     `json:"overhead_ms"`
	UpstreamTTFB   Dist     `json:"upstream_ttfb_ms"`
	// The client's side, network included (the access log's client_*).
	ClientTTFT Dist `json:"client_ttft_ms"`
	ClientTTFA Dist `json:"client_ttfa_ms"`
	ClientE2E  Dist `json:"client_e2e_ms"`
	// Reading is how the group's streams read (absent: none read).
	Reading *Reading `json:"reading,omitempty"`
}

// Reading is how a group's streams read to a reader at their route's
// pace (metrics.Reading; docs/MEASUREMENT.md, "How the stream read"):
// one value a stream in each distribution.
type Reading struct {
	Streams int64 `json:"streams"`
	// StallRate is the share of streams with a stall (a wait of a pace
	// or more).
	StallRate float64 `json:"stall_rate"`
	QoE       Dist    `json:"qoe"`
	Fluidity  Dist    `json:"fluidity"`
	StallMS   Dist    `json:"stall_ms"`
	// HeldBy counts the streams whose reader waited by the hop that held
	// its longest wait (upstream, gateway, client); HeldShare is each
	// hop's share of them.
	HeldBy    map[string]int64   `json:"held_by"`
	HeldShare map[string]float64 `json:"held_share"`
}

// makeReading renders a's streams' reading (nil: none read).
func makeReading(a *agg) *Reading {
	ra := a.rd
	if ra == nil || ra.readings == 0 {
		return nil
	}
	r := &Reading{Streams: ra.readings, StallRate: math.Round(float64(ra.stalled)/float64(ra.readings)*1e4) / 1e4,
		QoE: makeScoreDist(&ra.d[rQoE]), Fluidity: makeScoreDist(&ra.d[rFluidity]), StallMS: makeDist(&ra.d[rStall]),
		HeldBy: map[string]int64{}, HeldShare: map[string]float64{}}
	var waited int64
	for h := 1; h < len(ra.held); h++ {
		waited += ra.held[h]
	}
	for h := 1; h < len(ra.held); h++ {
		n := metrics.HopNames[h]
		r.HeldBy[n] = ra.held[h]
		if waited > 0 {
			r.HeldShare[n] = math.Round(float64(ra.held[h])/float64(waited)*1e4) / 1e4
		}
	}
	return r
}

func (g *Group) key() Key { return Key{g.Route, g.Model, g.Tenant, g.Upstream, g.Class, g.Shadow} }

// dists returns the group's measures in the order of the m* constants.
func (g *Group) dists() [numPublic]*Dist {
	return [numPublic]*Dist{&g.TTFT, &g.TTFA, &g.ITL, &g.TPOT, &g.E2E, &g.Queue, &g.Overhead, &g.UpstreamTTFB, &g.ClientTTFT, &g.ClientTTFA, &g.ClientE2E}
}

// Goodput is the share of judged requests that met their SLO.
type Goodput struct {
	// Judged is the requests judged against an SLO; Good those that met
	// it; Ratio is Good / Judged (null when none was judged).
	Judged int64    `json:"judged"`
	Good   int64    `json:"good"`
	Ratio  *float64 `json:"ratio"`
	// Target is the SLO's goodput objective (null: none).
	Target *float64 `json:"target"`
	// Missed counts the requests that missed each objective (a request
	// can miss several): ttft, ttfa, tpot, e2e and failed.
	Missed map[string]int64 `json:"missed"`
}

// Dist is one measure's distribution over the window, in milliseconds:
// quantiles within RelativeAccuracy of exact, max and mean exact. With
// Count 0 every value is 0.
type Dist struct {
	Count int64   `json:"count"`
	P50   float64 `json:"p50"`
	P90   float64 `json:"p90"`
	P95   float64 `json:"p95"`
	P99   float64 `json:"p99"`
	Max   float64 `json:"max"`
	Mean  float64 `json:"mean"`
}

func round3(v float64) float64 { return math.Round(v*1000) / 1000 }

func round6(v float64) float64 { return math.Round(v*1e6) / 1e6 }

func makeDist(d *dist) Dist {
	if d.count() == 0 {
		return Dist{}
	}
	return Dist{Count: d.count(), P50: round3(d.quantile(0.50)), P90: round3(d.quantile(0.90)), P95: round3(d.quantile(0.95)),
		P99: round3(d.quantile(0.99)), Max: round3(d.maximum()), Mean: round3(d.mean())}
}

// makeScoreDist is the distribution of a score whose low values are the
// bad ones (qoe, fluidity): its p90, p95 and p99 are the scores 90, 95 and
// 99% of the values reached (the 10th, 5th and 1st percentiles), so that
// p99 reads as a latency's does: the tail that matters.
func makeScoreDist(d *dist) Dist {
	if d.count() == 0 {
		return Dist{}
	}
	return Dist{Count: d.count(), P50: round3(d.quantile(0.50)), P90: round3(d.quantile(0.10)), P95: round3(d.quantile(0.05)),
		P99: round3(d.quantile(0.01)), Max: round3(d.maximum()), Mean: round3(d.mean())}
}

func makeGoodput(a *agg, target float64) Goodput {
	g := Goodput{Judged: a.judged, Good: a.good, Missed: map[string]int64{}}
	for i, n := range metrics.SLONames {
		g.Missed[n] = a.missed[i]
	}
	if a.judged > 0 {
		r := math.Round(float64(a.good)/float64(a.judged)*1e4) / 1e4
		g.Ratio = &r
	}
	if target > 0 {
		g.Target = &target
	}
	return g
}

// group_ renders a group's merged agg over span.
func group_(k Key, a *agg, span time.Duration, target float64) Group {
	g := Group{Route: k.Route, Model: k.Model, Tenant: k.Tenant, Upstream: k.Upstream, Class: k.Class, Shadow: k.Shadow,
		Count: a.count, Errors: a.errors, Limited: a.limited, Refused: a.refused,
		RequestsPerS:     round3(float64(a.count) / span.Seconds()),
		OutputTokensPerS: round3(float64(a.outTokens) / span.Seconds()),
		Goodput:          makeGoodput(a, target),
		CostUSD:          float64(a.costMicro) / 1e6, Priced: a.priced, CacheReported: a.cacheReported,
	}
	if a.priced > 0 && a.good > 0 {
		c := round6(float64(a.costMicro) / 1e6 / float64(a.good))
		g.CostPerGoodUSD = &c
	}
	if a.cacheReported > 0 {
		h := math.Round(float64(a.cacheHits)/float64(a.cacheReported)*1e4) / 1e4
		g.CacheHitShare = &h
	}
	for i, d := range g.dists() {
		*d = makeDist(&a.d[i])
	}
	g.Reading = makeReading(a)
	return g
}
