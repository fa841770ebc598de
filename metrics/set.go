package metrics

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	vm "github.com/VictoriaMetrics/metrics"
)

// Measures lists the histogram measures whose bucket bounds a config can
// set, by their short names (tokentap_<name>_seconds).
var Measures = []string{"ttft", "ttfa", "itl", "tpot", "e2e", "queue", "overhead", "upstream_ttfb", "server_queue", "server_prefill", "server_decode", "client_ttft", "client_e2e", "stream_stall"}

// DefaultBuckets are the bucket upper bounds, in seconds, of each measure
// where the config sets none. They hold the thresholds SLOs are usually
// written with (TTFT 0.5, 1, 2.5 s; TPOT 50 ms), so that the share of
// requests under an objective is read exactly from the buckets, and stay
// few: each bound is a series per route × model.
var DefaultBuckets = map[string][]float64{
	"ttft":           {0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120},
	"ttfa":           {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300},
	"itl":            {0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1},
	"tpot":           {0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1},
	"e2e":            {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600},
	"queue":          {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10},
	"overhead":       {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1},
	"upstream_ttfb":  {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120},
	"server_queue":   {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60},
	"server_prefill": {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60},
	"server_decode":  {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600},
	"client_ttft":    {0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120},
	"client_e2e":     {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600},
	"stream_stall":   {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
}

// scoreBuckets are the bounds of the reading scores' histograms (QoE and
// fluidity, 0 to 1).
var scoreBuckets = []float64{0.1, 0.25, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1}

func init() {
	// HELP and TYPE lines on /metrics, as Prometheus expects.
	vm.ExposeMetadata(true)
}

// CheckBuckets validates bucket bounds for a measure: a known measure, at
// least one bound, positive and strictly increasing.
func CheckBuckets(measure string, b []float64) error {
	if _, ok := DefaultBuckets[measure]; !ok {
		return fmt.Errorf("unknown measure %q (known: %s)", measure, strings.Join(Measures, ", "))
	}
	if len(b) == 0 {
		return fmt.Errorf("needs at least one bound")
	}
	for i, v := range b {
		if !(v > 0) || (i > 0 && v <= b[i-1]) {
			return fmt.Errorf("bounds must be positive and increasing, in seconds")
		}
	}
	return nil
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
	series [][]*Series // [row][model]; the last model is "other"
	// unmatched counts requests that matched no route or could not be parsed.
	unmatched *Series
	tenants   map[string]*TenantSeries

	// What each route learned (learn.go): its models past the allowlist,
	// their series by row and slot.
	byRoute   []*routeModels
	rowRoute  []*routeModels // by row
	learned   [][]atomic.Pointer[Series]
	upstreams []string // by row
	buckets   func(string) []float64
	slo       bool
	noSeries  bool
}

// SetOptions are what a Set is built with besides its labels.
type SetOptions struct {
	// Buckets overrides DefaultBuckets per measure. A series keeps the
	// bounds it was first created with for the life of the process.
	Buckets map[string][]float64
	// SLO adds the goodput counters to every series.
	SLO bool
	// NoSeries makes the routes' series labels only: no histogram or
	// counter is made or fed (measurement.series: false). The tenants'
	// series and the gauges stay.
	NoSeries bool
	// PerRoute is how many models past the allowlist and its own literals
	// each route labels, the first it sees (0: DefaultPerRoute; -1: none).
	PerRoute int
	// Carry is the Set of the configuration being replaced: each route
	// keeps the models it learned there.
	Carry *Set
}

// UnmatchedRoute is the route label of requests that matched no route.
const UnmatchedRoute = "unmatched"

// Series is the handles for one (route, model) label pair. Series that
// most pairs never see (server timings, most outcome × status class
// pairs) are created at their first use, so an idle scrape stays short.
type Series struct {
	route, upstream, model            string
	labels                            string
	buckets                           func(string) []float64
	ttft, ttfa, itl, tpot, e2e, queue *vm.PrometheusHistogram
	overhead, ttfb                    *vm.PrometheusHistogram
	clientTTFT, clientE2E             *vm.PrometheusHistogram
	serverOnce                        sync.Once
	serverQueue, serverPrefill        *vm.PrometheusHistogram
	serverDecode                      *vm.PrometheusHistogram
	readingOnce                       sync.Once // rd, at the first stream read
	rd                                *readingSeries
	outTokens, inTokens, items        *vm.Counter
	requests                          [numOutcomes][5]atomic.Pointer[vm.Counter] // [outcome][status class]
	judged, good                      *vm.Counter                                // nil without SLOs
	missed                            [NumSLO]*vm.Counter
}

// Model is the series' model label: a model of the config, or the label
// of all others ("" for a nil Series).
func (s *Series) Model() string {
	if s == nil {
		return ""
	}
	return s.model
}

// RouteRow is one row of a Set's series: a route, or one upstream of a
// route with several (Upstream "" otherwise: no upstream label). Models
// are the model names the route's globs give literally: its own labels.
type RouteRow struct {
	Route, Upstream string
	Models          []string
}

// NewSet builds every series for the given rows and model allowlist.
func NewSet(routes []RouteRow, models []string, o SetOptions) *Set {
	s := &Set{set: vm.NewSet(), models: make(map[string]int, len(models))}
	labels := append(append([]string(nil), models...), OtherModel)
	for i, m := range models {
		s.models[m] = i
	}
	buckets := func(m string) []float64 {
		if b, ok := o.Buckets[m]; ok {
			return b
		}
		return DefaultBuckets[m]
	}
	for _, route := range routes {
		row := make([]*Series, len(labels))
		for j, model := range labels {
			row[j] = newSeries(route.Route, route.Upstream, model, buckets, o.SLO, o.NoSeries)
		}
		s.series = append(s.series, row)
	}
	s.unmatched = newSeries(UnmatchedRoute, "", OtherModel, buckets, false, o.NoSeries)
	s.learnRoutes(routes, o)
	return s
}

// learnRoutes sets up what each route learns (learn.go): its literals
// first, then what it learned in o.Carry.
func (s *Set) learnRoutes(routes []RouteRow, o SetOptions) {
	s.buckets, s.slo, s.noSeries = func(m string) []float64 {
		if b, ok := o.Buckets[m]; ok {
			return b
		}
		return DefaultBuckets[m]
	}, o.SLO, o.NoSeries
	per := o.PerRoute
	if per == 0 {
		per = DefaultPerRoute
	}
	per = max(per, 0)
	for i, r := range routes {
		s.upstreams = append(s.upstreams, r.Upstream)
		var rm *routeModels
		for _, x := range s.byRoute {
			if x.route == r.Route {
				rm = x
			}
		}
		if rm == nil {
			rm = &routeModels{route: r.Route}
			for _, m := range r.Models {
				if _, static := s.models[m]; !static && learnable([]byte(m)) && !slices.Contains(rm.order, m) {
					rm.order = append(rm.order, m)
				}
			}
			rm.limit = len(rm.order) + per
			s.byRoute = append(s.byRoute, rm)
		}
		rm.rows = append(rm.rows, i)
		s.rowRoute = append(s.rowRoute, rm)
	}
	for _, rm := range s.byRoute {
		if o.Carry != nil {
			for _, m := range o.Carry.LearnedModels(rm.route) {
				if _, static := s.models[m]; !static && !slices.Contains(rm.order, m) && len(rm.order) < rm.limit {
					rm.order = append(rm.order, m)
				}
			}
		}
		names := map[string]int{}
		for slot, m := range rm.order {
			names[m] = s.OtherIndex() + 1 + slot
		}
		rm.names.Store(&names)
	}
	s.learned = make([][]atomic.Pointer[Series], len(routes))
	for row := range routes {
		rm := s.rowRoute[row]
		s.learned[row] = make([]atomic.Pointer[Series], rm.limit)
		for slot, m := range rm.order {
			s.learned[row][slot].Store(newSeries(rm.route, s.upstreams[row], m, s.buckets, s.slo, s.noSeries))
		}
	}
}

// Unmatched returns the series of requests that matched no route.
func (s *Set) Unmatched() *Series { return s.unmatched }

// newSeries makes the series of one label pair; with labelsOnly, only
// its labels (Observe and ITL then feed nothing).
func newSeries(route, upstream, model string, buckets func(string) []float64, slo, labelsOnly bool) *Series {
	l := fmt.Sprintf(`route=%q,model=%q`, route, model)
	if upstream != "" {
		l = fmt.Sprintf(`route=%q,upstream=%q,model=%q`, route, upstream, model)
	}
	x := &Series{route: route, upstream: upstream, model: model, labels: l, buckets: buckets}
	if labelsOnly {
		return x
	}
	h := x.histogram
	x.ttft, x.ttfa, x.itl, x.tpot = h("ttft"), h("ttfa"), h("itl"), h("tpot")
	x.e2e, x.queue, x.overhead, x.ttfb = h("e2e"), h("queue"), h("overhead"), h("upstream_ttfb")
	x.clientTTFT, x.clientE2E = h("client_ttft"), h("client_e2e")
	x.outTokens = durable.GetOrCreateCounter("tokentap_output_tokens_total{" + l + "}")
	x.inTokens = durable.GetOrCreateCounter("tokentap_input_tokens_total{" + l + "}")
	x.items = durable.GetOrCreateCounter("tokentap_items_total{" + l + "}")
	if slo {
		x.judged = durable.GetOrCreateCounter("tokentap_slo_judged_requests_total{" + l + "}")
		x.good = durable.GetOrCreateCounter("tokentap_goodput_requests_total{" + l + "}")
		for i, n := range SLONames {
			if m := SLOMisses(1 << i); m == SLOUnacked || m == SLOQoE {
				continue // rare, or set by few: made at its first use (missedCounter), as request counters are
			}
			x.missed[i] = durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_slo_missed_total{%s,slo=%q}`, l, n))
		}
	}
	return x
}

// missedCounter is the counter of misses of objective i, made at its first
// use when it was not made with the series.
func (x *Series) missedCounter(i int) *vm.Counter {
	if c := x.missed[i]; c != nil {
		return c
	}
	return durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_slo_missed_total{%s,slo=%q}`, x.labels, SLONames[i]))
}

func (x *Series) histogram(measure string) *vm.PrometheusHistogram {
	return durable.GetOrCreatePrometheusHistogramExt("tokentap_"+measure+"_seconds{"+x.labels+"}", x.buckets(measure))
}

// Labels returns the route, upstream ("" when the route has one) and
// model label values of x.
func (x *Series) Labels() (route, upstream, model string) { return x.route, x.upstream, x.model }

// requestCounter returns the counter of one outcome × status class,
// creating it at its first use.
func (x *Series) requestCounter(o, c int) *vm.Counter {
	if p := x.requests[o][c].Load(); p != nil {
		return p
	}
	name := fmt.Sprintf(`tokentap_requests_total{%s,outcome=%q,status_class=%q}`, x.labels, Outcomes[o], statusClasses[c])
	x.requests[o][c].CompareAndSwap(nil, durable.GetOrCreateCounter(name))
	return x.requests[o][c].Load()
}

// ModelIndex returns the index of model on row: the allowlist's, or one
// the row's route labels (its literals, or one it learned now or before:
// learn.go), or that of "other". It allocates only as a route learns a
// model.
func (s *Set) ModelIndex(row int, model []byte) int {
	if i, ok := s.models[string(model)]; ok {
		return i
	}
	if len(model) == 0 || row < 0 || row >= len(s.rowRoute) {
		return len(s.models)
	}
	rm := s.rowRoute[row]
	if i, ok := (*rm.names.Load())[string(model)]; ok {
		return i
	}
	return s.learn(rm, model)
}

// OtherIndex returns the index of the "other" model, for a request whose
// model is not known yet.
func (s *Set) OtherIndex() int { return len(s.models) }

// Allowed reports whether model is in the allowlist.
func (s *Set) Allowed(model []byte) bool {
	_, ok := s.models[string(model)]
	return ok
}

// Series returns the handles for a row index (as given to NewSet) and a
// model index from ModelIndex on a row of the same route.
func (s *Set) Series(row, model int) *Series {
	if model <= len(s.models) {
		return s.series[row][model]
	}
	return s.learned[row][model-len(s.models)-1].Load()
}

// AddGauge adds a gauge of this generation, read at scrape time. name
// carries its labels, from the config only.
func (s *Set) AddGauge(name string, f func() float64) { s.set.NewGauge(name, f) }

// Register makes the set part of what /metrics exposes.
func (s *Set) Register() { vm.RegisterSet(s.set) }

// Unregister removes the set from /metrics.
func (s *Set) Unregister() { vm.UnregisterSet(s.set, true) }

// ITL records one inter-token gap, as it happens.
func (x *Series) ITL(gap time.Duration) {
	if x.itl != nil {
		x.itl.Update(gap.Seconds())
	}
}

// Observe feeds a finished record into its series (r.Series; records
// without one are ignored). ITL gaps are not repeated here: they were
// recorded live through ITL.
func (s *Set) Observe(r *Record) {
	if r.TenantSeries != nil {
		r.TenantSeries.observe(r)
	}
	account(r)
	x := r.Series
	if x == nil || x.ttft == nil { // labels only: NoSeries
		return
	}
	// A request answered by tokentap, never sent upstream, is counted by
	// outcome and judged, and timed in no histogram: a refusal is no
	// latency of the route.
	served := !r.Refused()
	update := func(h *vm.PrometheusHistogram, d time.Duration) {
		if d >= 0 && served {
			h.Update(d.Seconds())
		}
	}
	update(x.ttft, r.TTFT)
	update(x.ttfa, r.TTFA)
	if r.ServerQueue >= 0 || r.ServerPrefill >= 0 || r.ServerDecode >= 0 {
		x.serverOnce.Do(func() {
			x.serverQueue, x.serverPrefill, x.serverDecode = x.histogram("server_queue"), x.histogram("server_prefill"), x.histogram("server_decode")
		})
		update(x.serverQueue, r.ServerQueue)
		update(x.serverPrefill, r.ServerPrefill)
		update(x.serverDecode, r.ServerDecode)
	}
	update(x.tpot, r.TPOT)
	update(x.e2e, r.E2E)
	update(x.queue, r.Queue)
	update(x.overhead, r.Overhead)
	update(x.ttfb, r.UpstreamTTFB)
	update(x.clientTTFT, r.ClientTTFT)
	update(x.clientE2E, r.ClientE2E)
	if rd := &r.Reading; rd.Tokens > 0 && served {
		x.observeReading(rd)
	}
	if r.OutputTokens > 0 {
		x.outTokens.Add(r.OutputTokens)
	}
	if r.InputTokens > 0 {
		x.inTokens.Add(r.InputTokens)
	}
	if r.Items > 0 {
		x.items.Add(r.Items)
	}
	x.requestCounter(outcomeIndex(r.Outcome), classIndex(r.Status)).Inc()
	if x.good != nil && r.SLOJudged {
		x.judged.Inc()
		if r.SLOMisses == 0 {
			x.good.Inc()
		}
		for i := range NumSLO {
			if r.SLOMisses.Has(i) {
				x.missedCounter(i).Inc()
			}
		}
	}
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

// observeReading feeds how a stream read to its series, made at the first
// stream the label pair reads.
func (x *Series) observeReading(rd *Reading) {
	x.readingOnce.Do(func() {
		h := func(name string, b []float64) *vm.PrometheusHistogram {
			return durable.GetOrCreatePrometheusHistogramExt("tokentap_"+name+"{"+x.labels+"}", b)
		}
		s := &readingSeries{qoe: h("stream_qoe", scoreBuckets), fluidity: h("stream_fluidity", scoreBuckets),
			stall: h("stream_stall_seconds", x.buckets("stream_stall"))}
		for i := 1; i < len(HopNames); i++ {
			s.held[i] = durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_stream_stalls_total{%s,held_by=%q}`, x.labels, HopNames[i]))
		}
		x.rd = s
	})
	s := x.rd
	s.qoe.Update(rd.QoE)
	s.fluidity.Update(rd.Fluidity)
	s.stall.Update(rd.Stall.Seconds())
	if int(rd.HeldBy) < len(s.held) && s.held[rd.HeldBy] != nil {
		s.held[rd.HeldBy].Inc()
	}
}

// readingSeries are a label pair's series of how its streams read.
type readingSeries struct {
	qoe, fluidity, stall *vm.PrometheusHistogram
	held                 [len(HopNames)]*vm.Counter // by hop; none for HopNone
}
