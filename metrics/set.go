package metrics

import (
	"fmt"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
)

// Bucket upper bounds, in seconds. Doubling steps keep the relative error of
// an interpolated quantile under 2× everywhere while covering both the
// millisecond gaps of fast decoders and the multi-minute first tokens of
// reasoning models (fixed buckets stopping at 10 s overflow there).
var (
	latencyBuckets  = doubling(0.001, 22)   // 1 ms … ~35 min: TTFT, E2E, TTFB, queue
	tokenBuckets    = doubling(0.0005, 18)  // 0.5 ms … ~65 s: ITL, TPOT
	overheadBuckets = doubling(0.00001, 18) // 10 µs … ~1.3 s: gateway overhead
)

func doubling(start float64, n int) []float64 {
	b := make([]float64, n)
	for i := range b {
		b[i] = start
		start *= 2
	}
	return b
}

// OtherModel is the label value of every model not in the allowlist.
const OtherModel = "other"

var statusClasses = []string{"1xx", "2xx", "3xx", "4xx", "5xx"}

// durable holds every counter and histogram, keyed by name and label
// values, for the life of the process: a reload that keeps a route, model or
// tenant keeps counting on the same series, and a request that started
// before the reload and finishes after it counts there too. Only gauges,
// which are read from the running config, live in a generation's own set.
// Series of a route or model a reload removed stay exposed, at their last
// values (Prometheus counters never go back), so their number is bounded by
// the configs the process has run with.
var durable = func() *vm.Set {
	s := vm.NewSet()
	vm.RegisterSet(s)
	return s
}()

// Set holds the metric handles of one config generation: one Series per
// (route, model) pair, where models are the allowlist plus "other". Label
// values come only from the config, so clients cannot add series. A Set is
// safe for concurrent use; register it with Register and drop it with
// Unregister when a new config replaces it (its counters and histograms
// live on, see durable).
type Set struct {
	set    *vm.Set // gauges of this generation
	models map[string]int
	series [][]*Series // [route][model]; the last model is "other"
	// unmatched counts requests that matched no route or could not be parsed.
	unmatched *Series
	tenants   map[string]*TenantSeries
}

// UnmatchedRoute is the route label of requests that matched no route.
const UnmatchedRoute = "unmatched"

// Series is the handles for one (route, model) label pair.
type Series struct {
	ttft, ttfa, itl, tpot, e2e, queue, overhead, ttfb *vm.PrometheusHistogram
	serverQueue, serverPrefill, serverDecode          *vm.PrometheusHistogram
	outTokens, inTokens, items                        *vm.Counter
	requests                                          [numOutcomes][5]*vm.Counter // [outcome][status class]
}

// NewSet builds every series for the given route names and model allowlist.
func NewSet(routes, models []string) *Set {
	s := &Set{set: vm.NewSet(), models: make(map[string]int, len(models))}
	labels := append(append([]string(nil), models...), OtherModel)
	for i, m := range models {
		s.models[m] = i
	}
	for _, route := range routes {
		row := make([]*Series, len(labels))
		for j, model := range labels {
			row[j] = s.newSeries(route, model)
		}
		s.series = append(s.series, row)
	}
	s.unmatched = s.newSeries(UnmatchedRoute, OtherModel)
	return s
}

// Unmatched returns the series of requests that matched no route.
func (s *Set) Unmatched() *Series { return s.unmatched }

func (s *Set) newSeries(route, model string) *Series {
	l := fmt.Sprintf(`route=%q,model=%q`, route, model)
	h := func(name string, b []float64) *vm.PrometheusHistogram {
		return durable.GetOrCreatePrometheusHistogramExt(name+"{"+l+"}", b)
	}
	x := &Series{
		ttft:      h("tokentap_ttft_seconds", latencyBuckets),
		ttfa:      h("tokentap_ttfa_seconds", latencyBuckets),
		itl:       h("tokentap_itl_seconds", tokenBuckets),
		tpot:      h("tokentap_tpot_seconds", tokenBuckets),
		e2e:       h("tokentap_e2e_seconds", latencyBuckets),
		queue:     h("tokentap_queue_seconds", latencyBuckets),
		overhead:  h("tokentap_overhead_seconds", overheadBuckets),
		ttfb:      h("tokentap_upstream_ttfb_seconds", latencyBuckets),
		outTokens: durable.GetOrCreateCounter("tokentap_output_tokens_total{" + l + "}"),
		inTokens:  durable.GetOrCreateCounter("tokentap_input_tokens_total{" + l + "}"),
		items:     durable.GetOrCreateCounter("tokentap_items_total{" + l + "}"),
	}
	x.serverQueue = h("tokentap_server_queue_seconds", latencyBuckets)
	x.serverPrefill = h("tokentap_server_prefill_seconds", latencyBuckets)
	x.serverDecode = h("tokentap_server_decode_seconds", latencyBuckets)
	for i, o := range Outcomes {
		for j, c := range statusClasses {
			x.requests[i][j] = durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_requests_total{%s,outcome=%q,status_class=%q}`, l, o, c))
		}
	}
	return x
}

// ModelIndex returns the allowlist index of model, or the index of "other".
// It does not allocate.
func (s *Set) ModelIndex(model []byte) int {
	if i, ok := s.models[string(model)]; ok {
		return i
	}
	return len(s.models)
}

// OtherIndex returns the index of the "other" model, for a request whose
// model is not known yet.
func (s *Set) OtherIndex() int { return len(s.models) }

// Allowed reports whether model is in the allowlist.
func (s *Set) Allowed(model []byte) bool {
	_, ok := s.models[string(model)]
	return ok
}

// Series returns the handles for a route index (as given to NewSet) and a
// model index from ModelIndex.
func (s *Set) Series(route, model int) *Series { return s.series[route][model] }

// Register makes the set part of what /metrics exposes.
func (s *Set) Register() { vm.RegisterSet(s.set) }

// Unregister removes the set from /metrics.
func (s *Set) Unregister() { vm.UnregisterSet(s.set, true) }

// ITL records one inter-token gap, as it happens.
func (x *Series) ITL(gap time.Duration) { x.itl.Update(gap.Seconds()) }

// Observe feeds a finished record into its series (r.Series; records
// without one are ignored). ITL gaps are not repeated here: they were
// recorded live through ITL.
func (s *Set) Observe(r *Record) {
	if r.TenantSeries != nil {
		r.TenantSeries.observe(r)
	}
	x := r.Series
	if x == nil {
		return
	}
	update := func(h *vm.PrometheusHistogram, d time.Duration) {
		if d >= 0 {
			h.Update(d.Seconds())
		}
	}
	update(x.ttft, r.TTFT)
	update(x.ttfa, r.TTFA)
	update(x.serverQueue, r.ServerQueue)
	update(x.serverPrefill, r.ServerPrefill)
	update(x.serverDecode, r.ServerDecode)
	update(x.tpot, r.TPOT)
	update(x.e2e, r.E2E)
	update(x.queue, r.Queue)
	update(x.overhead, r.Overhead)
	update(x.ttfb, r.UpstreamTTFB)
	if r.OutputTokens > 0 {
		x.outTokens.Add(r.OutputTokens)
	}
	if r.InputTokens > 0 {
		x.inTokens.Add(r.InputTokens)
	}
	if r.Items > 0 {
		x.items.Add(r.Items)
	}
	x.requests[outcomeIndex(r.Outcome)][classIndex(r.Status)].Inc()
}

func outcomeIndex(o Outcome) int {
	for i, x := range Outcomes {
		if x == o {
			return i
		}
	}
	return 1 // unknown outcomes count as upstream errors
}

func classIndex(status int) int {
	c := status/100 - 1
	if c < 0 || c > 4 {
		return 4
	}
	return c
}
