package telemetry

import (
	"context"
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel/attribute"
	otelmetric "go.opentelemetry.io/otel/metric"
)

// The GenAI conventions' bucket boundaries.
var (
	durationBuckets = []float64{0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92}
	ttftBuckets     = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0}
	perTokenBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5}
	tokenBuckets    = []float64{1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864}
)

// instruments are the GenAI metrics. tokentap stands between the client
// and the server, so it fills both sides' names (docs/OPERATIONS.md, "OpenTelemetry"):
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
type instruments struct {
	old, latest                            bool
	duration, ttfc, tpoc, usage            otelmetric.Float64Histogram
	serverTTFT, serverTPOT, serverDuration otelmetric.Float64Histogram
	// v0.1.0's.
	infDuration, infTTFC, infTPOC            otelmetric.Float64Histogram
	inTokens, outTokens, cacheRead, cacheWrt otelmetric.Int64Counter
	reasoning                                otelmetric.Int64Counter
	// sets are the attribute sets of the label values seen, built once
	// (sets): used by the exporter's goroutine alone.
	sets map[setKey]*labelSets
}

// setKey is the label values a record's metrics carry.
type setKey struct {
	op, provider, route, model, addr, errorType string
}

// labelSets are one setKey's attribute sets as measurement options: base
// (the successful response's), all (with error.type where there is one)
// and the usage histogram's by token type.
// Each is a slice of one, passed on as it is (a variadic argument built
// at each call would be a new slice a measurement).
type labelSets struct {
	base, all, input, output []otelmetric.RecordOption
	added                    []otelmetric.AddOption // base, for the counters
}

// maxLabelSets bounds the sets kept; past it they are built again from
// nothing (the labels are the configuration's routes, models and
// upstreams: a bound is only passed after many reloads).
const maxLabelSets = 4096

// labels returns the attribute sets of r's label values (model: its
// metric label), built the first time they are seen.
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
	if k.addr != "" {
		host, port := splitAddr(k.addr)
		kv = append(kv, attrServerAddress.String(host))
		if port > 0 {
			kv = append(kv, attrServerPort.Int(port))
		}
	}
	opt := func(set attribute.Set) []otelmetric.RecordOption {
		return []otelmetric.RecordOption{otelmetric.WithAttributeSet(set)}
	}
	baseSet := attribute.NewSet(kv...)
	base := opt(baseSet)
	ls := &labelSets{base: base, all: base, input: opt(with(kv, attrTokenType.String("input"))), output: opt(with(kv, attrTokenType.String("output"))),
		added: []otelmetric.AddOption{otelmetric.WithAttributeSet(baseSet)}}
	if k.errorType != "" {
		ls.all = opt(with(kv, attrErrorType.String(k.errorType)))
	}
	in.sets[k] = ls
	return ls
}

// The semantic-conventions modes (Config.Semconv).
const (
	SemconvDefault = "default"
	SemconvLatest  = "latest"
	SemconvBoth    = "both"
)

func newInstruments(m otelmetric.Meter, mode string) (instruments, error) {
	in := instruments{old: mode != SemconvLatest, latest: mode == SemconvLatest || mode == SemconvBoth}
	var err error
	h := func(dst *otelmetric.Float64Histogram, name, unit, desc string, buckets []float64) {
		if err != nil {
			return
		}
		*dst, err = m.Float64Histogram(name, otelmetric.WithUnit(unit), otelmetric.WithDescription(desc),
			otelmetric.WithExplicitBucketBoundaries(buckets...))
	}
	c := func(dst *otelmetric.Int64Counter, name, desc string) {
		if err != nil {
			return
		}
		*dst, err = m.Int64Counter(name, otelmetric.WithUnit("{token}"), otelmetric.WithDescription(desc))
	}
	if in.old {
		h(&in.duration, "gen_ai.client.operation.duration", "s", "GenAI operation duration, as the client lived it.", durationBuckets)
		h(&in.ttfc, "gen_ai.client.operation.time_to_first_chunk", "s", "Time to the first chunk of a stream, as the client lived it.", ttftBuckets)
		h(&in.tpoc, "gen_ai.client.operation.time_per_output_chunk", "s", "Time between consecutive output chunks of a stream.", perTokenBuckets)
		h(&in.usage, "gen_ai.client.token.usage", "{token}", "Input and output tokens used.", tokenBuckets)
	}
	if in.latest {
		// semantic-conventions-genai v0.1.0.
		h(&in.infDuration, "gen_ai.client.inference.duration", "s", "GenAI inference duration, as the client lived it.", durationBuckets)
		h(&in.infTTFC, "gen_ai.client.inference.time_to_first_chunk", "s", "Time to the first chunk of a stream, as the client lived it.", ttftBuckets)
		h(&in.infTPOC, "gen_ai.client.inference.time_per_output_chunk", "s", "Time between consecutive output chunks of a stream.", perTokenBuckets)
		c(&in.inTokens, "gen_ai.client.inference.usage.input_tokens", "Input tokens, cache reads and writes included.")
		c(&in.outTokens, "gen_ai.client.inference.usage.output_tokens", "Output tokens.")
		c(&in.cacheRead, "gen_ai.client.inference.usage.cache_read.input_tokens", "Input tokens served from the prompt cache.")
		c(&in.cacheWrt, "gen_ai.client.inference.usage.cache_write.input_tokens", "Input tokens written to the prompt cache.")
		c(&in.reasoning, "gen_ai.client.inference.usage.reasoning.output_tokens", "Output tokens spent on reasoning, where the backend reports them.")
	}
	h(&in.serverTTFT, "gen_ai.server.time_to_first_token", "s", "Time to the first token, from the request written to the upstream.", ttftBuckets)
	h(&in.serverTPOT, "gen_ai.server.time_per_output_token", "s", "Time per output token after the first.", perTokenBuckets)
	h(&in.serverDuration, "gen_ai.server.request.duration", "s", "Time the upstream took, from the request written to its last byte.", durationBuckets)
	return in, err
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
	ctx := context.Background()
	ls := in.labels(r, model)
	set := ls.all

	e2e := r.ClientE2E
	if e2e < 0 {
		e2e = r.E2E
	}
	if e2e >= 0 {
		if in.old {
			in.duration.Record(ctx, e2e.Seconds(), set...)
		}
		if in.latest {
			in.infDuration.Record(ctx, e2e.Seconds(), set...)
		}
	}
	if r.E2E >= 0 && r.Status > 0 {
		in.serverDuration.Record(ctx, upstreamShare(r, r.E2E).Seconds(), set...)
	}
	if r.Outcome != metrics.OutcomeOK {
		return // the rest is about successful responses
	}
	ok := ls.base
	if r.Stream && r.TTFT >= 0 {
		ttft := r.ClientTTFT
		if ttft < 0 {
			ttft = r.TTFT
		}
		if in.old {
			in.ttfc.Record(ctx, ttft.Seconds(), ok...)
		}
		if in.latest {
			in.infTTFC.Record(ctx, ttft.Seconds(), ok...)
		}
		s := r.ServerTTFT
		if s < 0 {
			s = upstreamShare(r, r.TTFT)
		}
		in.serverTTFT.Record(ctx, s.Seconds(), ok...)
		for _, g := range gaps {
			if in.old {
				in.tpoc.Record(ctx, g.Seconds(), ok...)
			}
			if in.latest {
				in.infTPOC.Record(ctx, g.Seconds(), ok...)
			}
		}
	}
	if r.TPOT >= 0 {
		in.serverTPOT.Record(ctx, r.TPOT.Seconds(), ok...)
	}
	in.recordUsage(ctx, r, ls)
}

// recordUsage records the tokens r used: today's usage histogram, and
// v0.1.0's counters (cache reads, writes and reasoning apart).
func (in *instruments) recordUsage(ctx context.Context, r *metrics.Record, ls *labelSets) {
	if in.old {
		if r.InputTokens > 0 {
			in.usage.Record(ctx, float64(r.InputTokens), ls.input...)
		}
		if r.TokensSource != "" {
			in.usage.Record(ctx, float64(r.OutputTokens), ls.output...)
		}
	}
	if in.latest {
		if r.InputTokens > 0 {
			in.inTokens.Add(ctx, int64(r.InputTokens), ls.added...)
		}
		if r.TokensSource != "" {
			in.outTokens.Add(ctx, int64(r.OutputTokens), ls.added...)
		}
		if r.CachedTokens > 0 {
			in.cacheRead.Add(ctx, int64(r.CachedTokens), ls.added...)
		}
		if r.CacheWriteTokens > 0 {
			in.cacheWrt.Add(ctx, int64(r.CacheWriteTokens), ls.added...)
		}
		if r.ReasoningTokens > 0 {
			in.reasoning.Add(ctx, int64(r.ReasoningTokens), ls.added...)
		}
	}
}

// with is the set of kv and one more attribute. kv is left as it was:
// the appended copy is a slice of its own (attribute.NewSet sorts what it
// is given in place; two sets appended to one kv with room to spare shared
// its array, and the second lost an attribute of the first, the route).
func with(kv []attribute.KeyValue, more attribute.KeyValue) attribute.Set {
	return attribute.NewSet(append(slices.Clip(kv), more)...)
}
