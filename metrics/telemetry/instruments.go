package telemetry

import (
	"slices"
	"sort"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// The GenAI conventions' bucket boundaries.
var (
	durationBuckets = []float64{0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92}
	ttftBuckets     = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0}
	perTokenBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}
	tokenBuckets    = []float64{1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864}
)

// The GenAI metrics. tokentap stands between the client and the server,
// so it fills both sides' names (docs/OPERATIONS.md, "OpenTelemetry"):
//
//   - gen_ai.client.*: what the client lived: the client-side estimates
//     (network included) where tokentap has them, its own marks
//     otherwise; each inter-token gap as a chunk's time.
//   - gen_ai.server.*: the upstream as tokentap sees it: from the request
//     written upstream (queue, tokentap's own time, failed attempts and
//     the upload left out); the backend's own time to first token when it
//     reports one (vLLM).
//
// Which client names: today's (gen_ai.client.operation.*, the histogram
// gen_ai.client.token.usage), the GenAI conventions' first standalone
// release's (semantic-conventions-genai v0.1.0: gen_ai.client.inference.*
// and the usage counters with cache reads and writes), or both for a
// migration (Config.Semconv; OTEL_SEMCONV_STABILITY_OPT_IN).
const (
	mDuration = iota // today's client names
	mTTFC
	mTPOC
	mUsage
	mInfDuration // v0.1.0's
	mInfTTFC
	mInfTPOC
	mInTokens
	mOutTokens
	mCacheRead
	mCacheWrite
	mReasoning
	mServerTTFT // both
	mServerTPOT
	mServerDuration
	nMetrics
)

// metricDef is one metric: a histogram of bounds, or a counter (no
// bounds).
type metricDef struct {
	name, unit, desc string
	bounds           []float64
	latest, old      bool // its names' modes (neither: every mode)
}

var metricDefs = [nMetrics]metricDef{
	mDuration:       {"gen_ai.client.operation.duration", "s", "GenAI operation duration, as the client lived it.", durationBuckets, false, true},
	mTTFC:           {"gen_ai.client.operation.time_to_first_chunk", "s", "Time to the first chunk of a stream, as the client lived it.", ttftBuckets, false, true},
	mTPOC:           {"gen_ai.client.operation.time_per_output_chunk", "s", "Time between consecutive output chunks of a stream.", perTokenBuckets, false, true},
	mUsage:          {"gen_ai.client.token.usage", "{token}", "Input and output tokens used.", tokenBuckets, false, true},
	mInfDuration:    {"gen_ai.client.inference.duration", "s", "GenAI inference duration, as the client lived it.", durationBuckets, true, false},
	mInfTTFC:        {"gen_ai.client.inference.time_to_first_chunk", "s", "Time to the first chunk of a stream, as the client lived it.", ttftBuckets, true, false},
	mInfTPOC:        {"gen_ai.client.inference.time_per_output_chunk", "s", "Time between consecutive output chunks of a stream.", perTokenBuckets, true, false},
	mInTokens:       {"gen_ai.client.inference.usage.input_tokens", "{token}", "Input tokens, cache reads and writes included.", nil, true, false},
	mOutTokens:      {"gen_ai.client.inference.usage.output_tokens", "{token}", "Output tokens.", nil, true, false},
	mCacheRead:      {"gen_ai.client.inference.usage.cache_read.input_tokens", "{token}", "Input tokens served from the prompt cache.", nil, true, false},
	mCacheWrite:     {"gen_ai.client.inference.usage.cache_write.input_tokens", "{token}", "Input tokens written to the prompt cache.", nil, true, false},
	mReasoning:      {"gen_ai.client.inference.usage.reasoning.output_tokens", "{token}", "Output tokens spent on reasoning, where the backend reports them.", nil, true, false},
	mServerTTFT:     {"gen_ai.server.time_to_first_token", "s", "Time to the first token, from the request written to the upstream.", ttftBuckets, false, false},
	mServerTPOT:     {"gen_ai.server.time_per_output_token", "s", "Time per output token after the first.", perTokenBuckets, false, false},
	mServerDuration: {"gen_ai.server.request.duration", "s", "Time the upstream took, from the request written to its last byte.", durationBuckets, false, false},
}

// The attribute sets a label set's points carry.
const (
	setBase  = iota // the successful response's
	setAll          // with error.type where there is one
	setInput        // the usage histogram's, by token type
	setOutput
	nSets
)

// instruments aggregate the GenAI metrics of the records, on the
// exporter's goroutine alone, and export them every interval through the
// OTLP metric exporter. Recording through the SDK's instruments cost
// about 1 µs a measurement (its options, attribute de-duplication,
// exemplar filter and concurrent map); here a measurement is a bucket
// found in the point its label set already holds.
type instruments struct {
	on         [nMetrics]bool // the metrics recorded under the mode
	cumulative bool           // the exporter's temporality: points from their start, else since the last export
	since      time.Time      // the last export, a delta's start
	// sets are the label values seen, with their points: a bounded
	// number (maxLabelSets).
	sets map[setKey]*labelSets
}

// setKey is the label values a record's metrics carry.
type setKey struct {
	op, provider, route, model, addr, errorType string
}

// labelSets are one setKey's attribute sets, and its points by metric
// and set.
type labelSets struct {
	attrs  [nSets]attribute.Set
	points [nMetrics][nSets]*point
}

// point is one series: a histogram's buckets, or a counter's sum.
type point struct {
	start    time.Time
	count    uint64
	buckets  []uint64 // a histogram's, one more than its bounds
	sum      float64
	min, max float64
	total    int64 // a counter's
}

// maxLabelSets bounds the sets kept; past it their points start again
// from nothing (the labels are the configuration's routes, models and
// upstreams: a bound is only passed after many reloads).
const maxLabelSets = 4096

// labels returns the label sets of r's label values (model: its metric
// label), built the first time they are seen.
func (in *instruments) labels(r *metrics.Record, model string) *labelSets {
	k := setKey{op: operation(r), provider: provider(r.Dialect), route: r.Route, model: model, addr: r.UpstreamAddr, errorType: errorType(r)}
	if ls, ok := in.sets[k]; ok {
		return ls
	}
	if in.sets == nil || len(in.sets) >= maxLabelSets {
		in.sets = map[setKey]*labelSets{}
	}
	kv := make([]attribute.KeyValue, 0, 8)
	kv = append(kv, attrOperation.String(k.op), attrProvider.String(k.provider), attrRoute.String(k.route))
	if model != "" {
		kv = append(kv, attrRequestModel.String(model))
	}
	kv = appendAddr(kv, k.addr)
	ls := &labelSets{}
	ls.attrs[setBase] = attribute.NewSet(kv...)
	ls.attrs[setAll] = ls.attrs[setBase]
	if k.errorType != "" {
		ls.attrs[setAll] = with(kv, attrErrorType.String(k.errorType))
	}
	ls.attrs[setInput] = with(kv, attrTokenType.String("input"))
	ls.attrs[setOutput] = with(kv, attrTokenType.String("output"))
	in.sets[k] = ls
	return ls
}

// The semantic-conventions modes (Config.Semconv).
const (
	SemconvDefault = "default"
	SemconvLatest  = "latest"
	SemconvBoth    = "both"
)

// newInstruments records under mode's names, for an exporter of
// temporality t.
func newInstruments(mode string, t metricdata.Temporality) instruments {
	in := instruments{cumulative: t != metricdata.DeltaTemporality, since: time.Now()}
	old, latest := mode != SemconvLatest, mode == SemconvLatest || mode == SemconvBoth
	for m, d := range metricDefs {
		in.on[m] = (!d.old && !d.latest) || (d.old && old) || (d.latest && latest)
	}
	return in
}

// observe adds v to set s's point of each of the metrics ms recorded
// under the mode (on); add adds n to counter m's.
func (in *instruments) observe(ls *labelSets, s int, v float64, ms ...int) {
	for _, m := range ms {
		if in.on[m] {
			ls.observe(m, s, v)
		}
	}
}

func (in *instruments) add(ls *labelSets, m, n int) {
	if in.on[m] {
		ls.add(m, int64(n))
	}
}

// observe adds v to metric m's point of set s.
func (ls *labelSets) observe(m, s int, v float64) {
	p := ls.point(m, s)
	bounds := metricDefs[m].bounds
	p.buckets[sort.SearchFloat64s(bounds, v)]++
	if p.count == 0 || v < p.min {
		p.min = v
	}
	if p.count == 0 || v > p.max {
		p.max = v
	}
	p.count++
	p.sum += v
}

// add adds n to counter m's point of the base set (its count: how many
// times, which says whether it moved).
func (ls *labelSets) add(m int, n int64) {
	p := ls.point(m, setBase)
	p.total += n
	p.count++
}

func (ls *labelSets) point(m, s int) *point {
	p := ls.points[m][s]
	if p == nil {
		p = &point{start: time.Now()}
		if b := metricDefs[m].bounds; b != nil {
			p.buckets = make([]uint64, len(b)+1)
		}
		ls.points[m][s] = p
	}
	return p
}

// upstreamShare is the part of d that was the upstream's: d without the
// queue, tokentap's own time, failed attempts and the upload.
func upstreamShare(r *metrics.Record, d time.Duration) time.Duration {
	for _, t := range []time.Duration{r.Queue, r.Overhead, r.FailoverWait, r.Upload} {
		if t > 0 {
			d -= t
		}
	}
	return max(d, 0)
}

func (in *instruments) record(r *metrics.Record, model string, gaps []time.Duration) {
	ls := in.labels(r, model)

	e2e := r.ClientE2E
	if e2e < 0 {
		e2e = r.E2E
	}
	if e2e >= 0 {
		in.observe(ls, setAll, e2e.Seconds(), mDuration, mInfDuration)
	}
	if r.E2E >= 0 && r.Status > 0 {
		in.observe(ls, setAll, upstreamShare(r, r.E2E).Seconds(), mServerDuration)
	}
	if r.Outcome != metrics.OutcomeOK {
		return // the rest is about successful responses
	}
	if r.Stream && r.TTFT >= 0 {
		ttft := r.ClientTTFT
		if ttft < 0 {
			ttft = r.TTFT
		}
		in.observe(ls, setBase, ttft.Seconds(), mTTFC, mInfTTFC)
		s := r.ServerTTFT
		if s < 0 {
			s = upstreamShare(r, r.TTFT)
		}
		in.observe(ls, setBase, s.Seconds(), mServerTTFT)
		for _, g := range gaps {
			if in.on[mTPOC] {
				ls.observe(mTPOC, setBase, g.Seconds())
			}
			if in.on[mInfTPOC] {
				ls.observe(mInfTPOC, setBase, g.Seconds())
			}
		}
	}
	if r.TPOT >= 0 {
		in.observe(ls, setBase, r.TPOT.Seconds(), mServerTPOT)
	}
	in.recordUsage(r, ls)
}

// recordUsage records the tokens r used: today's usage histogram, and
// v0.1.0's counters (cache reads, writes and reasoning apart).
func (in *instruments) recordUsage(r *metrics.Record, ls *labelSets) {
	if r.InputTokens > 0 {
		in.observe(ls, setInput, float64(r.InputTokens), mUsage)
		in.add(ls, mInTokens, r.InputTokens)
	}
	if r.TokensSource != "" {
		in.observe(ls, setOutput, float64(r.OutputTokens), mUsage)
		in.add(ls, mOutTokens, r.OutputTokens)
	}
	if r.CachedTokens > 0 {
		in.add(ls, mCacheRead, r.CachedTokens)
	}
	if r.CacheWriteTokens > 0 {
		in.add(ls, mCacheWrite, r.CacheWriteTokens)
	}
	if r.ReasoningTokens > 0 {
		in.add(ls, mReasoning, r.ReasoningTokens)
	}
}

// with is the set of kv and one more attribute. kv is left as it was:
// the appended copy is a slice of its own (attribute.NewSet sorts what it
// is given in place; two sets appended to one kv with room to spare shared
// its array, and the second lost an attribute of the first, the route).
func with(kv []attribute.KeyValue, more attribute.KeyValue) attribute.Set {
	return attribute.NewSet(append(slices.Clip(kv), more)...)
}
