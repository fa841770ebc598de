package stats

import (
	"fmt"
	"time"
)

// Overload is what overload control (a route's overload:) sees of one
// upstream now: what its model learned, how well it predicts, and what it
// refused.
type Overload struct {
	Route    string `json:"route"`
	Upstream string `json:"upstream"`
	// Enforcing: the route sheds (overload.shed); without, the gate only
	// predicts.
	Enforcing bool `json:"enforcing"`
	// Known: the model believes something (requests measured lately);
	// the figures below it mean nothing without.
	Known    bool `json:"known"`
	InFlight int  `json:"in_flight"`
	// Knee is the in-flight level where the batch looks full; Limit the
	// most in flight at which a standard request is predicted to meet the
	// route's objectives (−1: none).
	Knee  float64 `json:"knee"`
	Limit int     `json:"limit"`
	// PredictedTTFTMs and PredictedTPOTMs are what a request sent now
	// would live, by the model (−1: unknown).
	PredictedTTFTMs float64 `json:"predicted_ttft_ms"`
	PredictedTPOTMs float64 `json:"predicted_tpot_ms"`
	// Bias is the predictions' mean relative error against what requests
	// then lived (positive: too long), AbsError its mean absolute value,
	// over Judged requests.
	Bias     float64 `json:"bias"`
	AbsError float64 `json:"abs_error"`
	Judged   int     `json:"judged"`
	// ArrivalsPerS and CompletionsPerS are requests a second lately;
	// Standing: the queue does not drain between arrivals.
	ArrivalsPerS    float64 `json:"arrivals_per_s"`
	CompletionsPerS float64 `json:"completions_per_s"`
	Standing        bool    `json:"standing"`
	// Shed is the requests refused since the start, ShedPerS lately;
	// Shedding: one was refused within the last ten seconds.
	Shed     int64     `json:"shed"`
	ShedPerS float64   `json:"shed_per_s"`
	Shedding bool      `json:"shedding"`
	LastShed time.Time `json:"last_shed,omitzero"`
	// Share is the upstream's share of its route's requests since the
	// configuration (0–1).
	Share float64 `json:"share"`
	// Why counts the requests sent to the upstream by why: balance (the
	// route's weights or fewest in flight), sticky, least_ttft (the least
	// predicted first token), probe (one that looked worse, kept
	// measured), explore (one without a prediction yet, or when the
	// known best would miss), prefix (its prompt's upstream),
	// prefix_moved (that one was past its bound), over_objective (nowhere
	// in time: where it holds up nobody who would be), free_in_time (the
	// soonest would queue it: one in time with a free place).
	Why map[string]int64 `json:"why,omitempty"`
	// CacheReported is the requests whose backend said how many input
	// tokens its prompt cache served; CacheHitShare the share of those
	// with some; TTFTHitMs and TTFTMissMs their mean first token (−1:
	// none), since the configuration.
	CacheReported int64   `json:"cache_reported"`
	CacheHitShare float64 `json:"cache_hit_share"`
	TTFTHitMs     float64 `json:"ttft_cache_hit_ms"`
	TTFTMissMs    float64 `json:"ttft_cache_miss_ms"`
	// Backend is what the upstream's metrics_url said last (nil: none
	// configured).
	Backend *BackendState `json:"backend,omitempty"`
}

// BackendState is the last scrape of an upstream's metrics: the requests
// it runs and holds waiting, all clients counted, and its KV cache's use
// (−1: not reported); Error why the last scrape failed, AgeS how old it is.
type BackendState struct {
	Running float64 `json:"running"`
	Waiting float64 `json:"waiting"`
	KVCache float64 `json:"kv_cache_usage"`
	AgeS    float64 `json:"age_s"`
	Error   string  `json:"error,omitempty"`
}

// OverloadWarning is the warning an upstream that sheds raises.
func OverloadWarning(o Overload) Warning {
	return Warning{Kind: WarnShedding, Route: o.Route, Upstream: o.Upstream,
		Values: map[string]float64{"shed_per_s": o.ShedPerS, "limit": float64(o.Limit), "in_flight": float64(o.InFlight), "predicted_ttft_ms": o.PredictedTTFTMs},
		Message: fmt.Sprintf("route %s: upstream %s is overloaded: shedding %.1f requests/s (%d in all); it serves its objectives up to %d in flight, %d now, a first token predicted in %.0f ms",
			o.Route, o.Upstream, o.ShedPerS, o.Shed, o.Limit, o.InFlight, o.PredictedTTFTMs)}
}
