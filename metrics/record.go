// Package metrics defines what tokentap measures for one request (Record)
// and the sinks that consume it: Prometheus histograms and counters
// (VictoriaMetrics/metrics) built per config generation, and the JSON access
// log written through zap.
//
// The proxy fills one Record per request and hands it to every Sink exactly
// once, when the request is over:
//
//	set := metrics.NewSet([]metrics.RouteRow{{Route: "default"}}, []string{"llama-3"}, metrics.SetOptions{})
//	s := set.Series(0, modelIndex)     // at request start
//	s.ITL(gap)                          // per inter-token gap, live
//	set.Observe(&rec)                   // once, at the end
package metrics

import "time"

// Outcome says how a request ended, from tokentap's point of view.
type Outcome string

// The outcomes a Record can carry.
const (
	// OutcomeOK: the upstream answered with a status below 500 and the
	// response reached the client completely.
	OutcomeOK Outcome = "ok"
	// OutcomeUpstreamError: the upstream could not be reached, answered 5xx,
	// broke the stream, or reported an error inside a 200 response.
	OutcomeUpstreamError Outcome = "upstream_error"
	// OutcomeUpstreamTimeout: connect, first-byte or idle-gap timeout.
	OutcomeUpstreamTimeout Outcome = "upstream_timeout"
	// OutcomeClientCancel: the client went away before the response ended.
	OutcomeClientCancel Outcome = "client_cancel"
	// OutcomeRejected: refused because tokentap could not serve it (the
	// shared admission store did not answer, the budget of request bodies
	// was spent): the service's failure.
	OutcomeRejected Outcome = "rejected"
	// OutcomeBadRequest: refused by tokentap itself as malformed or not allowed.
	OutcomeBadRequest Outcome = "bad_request"
	// OutcomeShutdown: still running when tokentap's drain at shutdown ran
	// out of time, and cut.
	OutcomeShutdown Outcome = "shutdown"
	// OutcomeLimited: refused for the client's own limits: an unknown key
	// (401), or its tenant past a rate, token, concurrency or day limit,
	// its queue full or its wait in it over (429).
	OutcomeLimited Outcome = "limited"
	// OutcomeShed: refused by overload control, the upstream predicted to
	// serve it past its objectives: the service's failure (it counts
	// against goodput: refusing is no way to meet an SLO).
	OutcomeShed Outcome = "shed"
)

// Outcomes lists every Outcome, in a fixed order.
var Outcomes = []Outcome{OutcomeOK, OutcomeUpstreamError, OutcomeUpstreamTimeout, OutcomeClientCancel, OutcomeRejected, OutcomeBadRequest, OutcomeShutdown, OutcomeLimited, OutcomeShed}

// numOutcomes is len(Outcomes).
const numOutcomes = 9

// The rule, the same in records, /stats, metrics, the example rules, the
// dashboards and OTel: a request the service failed counts against its
// route (an error, and not good in goodput); one refused for the client's
// own doing (a malformed request, an unknown key, its tenant's limits)
// says nothing of the route: it is counted apart and not judged; a client
// that left is neither an error nor good.

// Failure reports an outcome that is the service's failure: the backend's
// error or timeout, tokentap unable to serve (rejected), a cut at shutdown.
func (o Outcome) Failure() bool {
	switch o {
	case OutcomeUpstreamError, OutcomeUpstreamTimeout, OutcomeRejected, OutcomeShutdown, OutcomeShed:
		return true
	}
	return false
}

// Judged reports whether a request of this outcome is judged against its
// route's SLO: all but those refused for the client's own doing
// (bad_request, limited).
func (o Outcome) Judged() bool { return o != OutcomeBadRequest && o != OutcomeLimited }

// Absent marks a timing that did not happen (a non-streamed response has no
// TTFT; a rejected request has no upstream timings). It is never logged.
const Absent time.Duration = -1

// Record is what one request measured. Field names follow the access log.
// Durations are measured on one monotonic clock with microsecond
// resolution; Absent means "did not happen". A Record holds no references
// to request buffers, so sinks may keep it.
type Record struct {
	RequestID string
	Route     string
	Upstream  string // the route's upstream it went to, by name ("" for a route with one)
	Shadow    bool   // a copy sent to the route's shadow upstream, measured and discarded
	Model     string // the model named in the request, as sent ("" if none)
	Tenant    string
	Method    string
	// ClientProtocol is what the client spoke: "HTTP/1.1" (HTTP/1.0
	// included) or "HTTP/2".
	ClientProtocol string
	Path           string
	Dialect        string

	Status  int
	Outcome Outcome
	Stream  bool
	// Partial: some event was larger than the parser's bound, or the body
	// was not parsed (compressed, too large), so token figures may be low.
	Partial bool
	// Error is a short reason when Outcome is not ok.
	Error string

	// Priority is the request's priority on a route with overload control
	// (critical, standard, sheddable; "": none); Predicted what its
	// upstream's model predicted before it was sent
	// (Absent: no prediction), beside what it then lived.
	Priority  string
	Predicted Prediction

	Queue        time.Duration // held by admission control
	UpstreamTTFB time.Duration // upstream request written → first upstream response byte
	TTFT         time.Duration // arrival → first token event flushed to the client
	TTFA         time.Duration // arrival → first answer token (text or tool call) flushed
	ITLCount     int           // number of inter-token gaps
	ITLMean      time.Duration
	ITLP50       time.Duration
	ITLP99       time.Duration
	ITLMax       time.Duration
	TPOT         time.Duration // (E2E − TTFT) / (OutputTokens − 1)
	E2E          time.Duration // arrival → last byte flushed to the client
	Overhead     time.Duration // time tokentap added before the first token
	Upload       time.Duration // the request's first byte → its last, received by the kernel (when > 0)
	// The client's side, network included (estimates: docs/MEASUREMENT.md, "What the
	// client lived"). ClientRTT is the path's round trip, the kernel's
	// minimum RTT of the client connection (tcpi_min_rtt: delayed ACKs do
	// not inflate it); ClientSRTT the smoothed one (they do).
	ClientRTT  time.Duration
	ClientSRTT time.Duration
	// Attempts is the upstreams the request was sent to (more than one
	// after a failover); FailoverWait the time spent on those that failed.
	Attempts     int
	FailoverWait time.Duration
	ClientTTFT   time.Duration // client sent its request → first token reached it
	ClientTTFA   time.Duration // → first answer token reached it
	ClientE2E    time.Duration // → last byte reached it
	// ClientStall is how long writes to the client waited for it to take
	// bytes (its receive window was full: it read slowly), and
	// ClientStallTTFT the part of it before the first token was delivered:
	// time the client caused, which the canary guard leaves out.
	ClientStall, ClientStallTTFT time.Duration
	// Reading is how the stream read to a reader at the route's pace, on
	// the client's clock where the record has it (Reading.Tokens 0: not a
	// stream with tokens).
	Reading Reading

	// Server-side timings, when the backend reports them.
	ServerQueue   time.Duration
	ServerLoad    time.Duration
	ServerPrefill time.Duration
	ServerDecode  time.Duration
	// ServerTTFT is the backend's own time to first token, from when it
	// scheduled the request (vLLM's per-request metrics).
	ServerTTFT time.Duration

	OutputTokens int
	InputTokens  int
	// CachedTokens is how many input tokens the backend served from its
	// prompt cache (a reused prefix), -1 when it does not say.
	CachedTokens int
	// CacheWriteTokens is how many input tokens the backend wrote to its
	// prompt cache (Anthropic's cache_creation_input_tokens; 0 where a
	// dialect has none). InputTokens holds them, and CachedTokens.
	CacheWriteTokens int
	// ReasoningTokens is how many of the output tokens were reasoning,
	// where the backend's usage says (−1: it does not).
	ReasoningTokens int
	// UsageSource says where the tokens came from: UsageProvider (the
	// backend's usage block), UsageCounted (none: tokentap counted the
	// stream's tokens, the input estimated from the body's size),
	// UsageEstimated (neither: the input from the body's size alone) or
	// UsageRejected (the backend's could not be true: counted and
	// estimated as without one).
	UsageSource string
	// Cost is what the request cost and at which price.
	Cost Cost
	// Class is the request's class (proxy.Classes): its input and output
	// sizes and whether its prefix was reused, so that upstreams are
	// compared like with like. Empty outside a route.
	Class        string
	TokensSource string // "usage", "counted" or "" when unknown
	Events       int    // token events
	BytesIn      int64  // request body bytes from the client
	BytesOut     int64  // response body bytes to the client
	Items        int    // results of a non-generating call (embeddings)
	// BytesWire is what tokentap wrote to the client connection for this
	// response (status line, headers, framing and body); BytesAcked how
	// much of it the client's kernel acknowledged (TCP_INFO
	// tcpi_bytes_acked), -1 when unknown. Unacked: bytes stayed
	// unacknowledged while tokentap watched (up to about two round trips
	// after the last write): the client did not provably receive it all.
	BytesWire  int64
	BytesAcked int64
	Unacked    bool
	// ClientRetrans is the segments the kernel sent again on the client
	// connection since its previous request (loss on the path).
	ClientRetrans int

	// SLOJudged says the request was judged against an SLO; SLOMisses is
	// what it missed (none: a good request) and SLOTarget the goodput
	// objective of that SLO (0: none).
	SLOJudged bool
	SLOMisses SLOMisses
	SLOTarget float64

	// Start is the request's arrival, the start of its span (wall clock).
	Start time.Time
	// MaxTokens is the output bound the request asked for (0: none given).
	MaxTokens int
	// UpstreamAddr is the host:port of the upstream it went to ("" when
	// it went to none).
	UpstreamAddr string
	// ResponseModel and FinishReason are what the response said: the
	// model that answered and why the generation ended ("" when it did
	// not say). They are read only while tracing (proxy.Options.Tracer).
	ResponseModel, FinishReason string
	// Trace is the request's trace context when tracing is on.
	Trace TraceContext
	// Tries are the attempts that failed before the last one (a
	// failover), oldest first; nil after a single attempt.
	Tries []Try

	// Series and TenantSeries are the metric handles chosen for this
	// request, if any.
	Series       *Series
	TenantSeries *TenantSeries
}

// Prediction is what an upstream's model predicted of a request before it
// was sent (Absent: no prediction).
type Prediction struct{ TTFT, TPOT time.Duration }

// Reading is how a stream read to a reader who reads a token every Pace
// from the first on and waits when the next has not come (the reader model
// of docs/MEASUREMENT.md, "How the stream read"), judged against a first
// token due TTFT after the request's start.
type Reading struct {
	// Tokens is the token events the model read (n); 0: no reading.
	Tokens int
	// QoE is min(1, (TTFT + (n−1)·Pace) / (the reader's end − start)):
	// 1 when the reader finished by the expected timeline.
	QoE float64
	// Fluidity is the share of tokens that came by their deadline, the
	// deadlines keeping their slack while tokens are on time.
	Fluidity float64
	// Stall is the reader's waits added up; Stalls the waits of at least
	// one Pace.
	Stall  time.Duration
	Stalls int
	// HeldBy is the hop that held the token behind the longest wait
	// (HopNone: the reader never waited).
	HeldBy Hop
}

// Hop is a hop of a token's way to the reader.
type Hop uint8

// The hops (Reading.HeldBy): the upstream sent the token's bytes late,
// tokentap wrote them late after reading them, or the client's side
// (its socket, its network) took them late.
const (
	HopNone Hop = iota
	HopUpstream
	HopGateway
	HopClient
)

// HopNames are the hops' names, in order: the record's held_by, the
// label held_by of tokentap_stream_stalls_total, and /stats.
var HopNames = [...]string{"", "upstream", "gateway", "client"}

// String is the hop's name ("" for HopNone).
func (h Hop) String() string {
	if int(h) < len(HopNames) {
		return HopNames[h]
	}
	return ""
}

// Refused reports a request tokentap answered itself and never sent
// upstream (shed, limited, rejected, malformed, or its client gone before
// it was sent): it is counted, and timed in no latency distribution, which
// hold the requests served.
func (r *Record) Refused() bool { return r.Attempts == 0 && r.Outcome != OutcomeOK }

// The sources of a record's token counts (Record.UsageSource).
const (
	UsageProvider  = "provider"
	UsageCounted   = "counted"
	UsageEstimated = "estimated"
	// UsageRejected: the backend's usage could not be true (a count that
	// is negative, fractional, not a number, or more than the request's
	// bytes and the response's bytes and time could carry) and was set
	// aside: the figures are tokentap's count and estimate.
	UsageRejected = "rejected"
)

// Cost is what a request cost at its model's price (Config.Prices).
type Cost struct {
	// USD is the cost in dollars; −1 when no price matches.
	USD float64
	// Basis says which price USD is at, where prices are configured:
	// CostModel (the served model's), CostDearest (the route's dearest:
	// the model had none and its tenant has a dollar budget) or
	// CostUnpriced (no price: USD absent); "" without prices.
	Basis string
}

// The prices a record's cost is at (Cost.Basis).
const (
	CostModel    = "model"
	CostDearest  = "route_max"
	CostUnpriced = "unpriced"
)

// Reset clears r for reuse, with every timing Absent.
func (r *Record) Reset() {
	*r = Record{
		Queue: Absent, UpstreamTTFB: Absent, TTFT: Absent, TTFA: Absent,
		ServerQueue: Absent, ServerLoad: Absent, ServerPrefill: Absent, ServerDecode: Absent, ServerTTFT: Absent,
		ITLMean: Absent, ITLP50: Absent, ITLP99: Absent, ITLMax: Absent,
		TPOT: Absent, E2E: Absent, Overhead: Absent, ClientRTT: Absent,
		ClientSRTT: Absent, FailoverWait: Absent, Upload: Absent, ClientTTFT: Absent, ClientTTFA: Absent, ClientE2E: Absent, BytesAcked: -1, CachedTokens: -1, Cost: Cost{USD: -1}, ReasoningTokens: -1,
		Predicted: Prediction{TTFT: Absent, TPOT: Absent},
	}
}

// TraceContext is a request's place in a distributed trace (W3C Trace
// Context): the trace, tokentap's span for the request, chosen when the
// request arrived so that the upstream request carries it in traceparent,
// and the client's span it is a child of.
type TraceContext struct {
	TraceID [16]byte
	SpanID  [8]byte
	// ParentID is the client's span (zero: the request came without a
	// traceparent, and tokentap's span is the trace's root).
	ParentID [8]byte
	// Sampled: the span is recorded and exported.
	Sampled bool
	// State is the client's tracestate, kept for the exported span.
	State string
}

// Valid reports a trace context that was started.
func (t *TraceContext) Valid() bool { return t.TraceID != [16]byte{} && t.SpanID != [8]byte{} }

// Try is one upstream attempt that failed and was followed by another
// (failover).
type Try struct {
	Upstream string // the upstream's name
	Addr     string // its host:port
	Start    time.Time
	Duration time.Duration
	Reason   string // why the request moved on (proxy.Failover*)
}

// Sink consumes finished records. Observe is called once per request from
// the goroutine that finished it; it must not block and must not keep r
// (copy it).
type Sink interface {
	Observe(r *Record)
}

// GapSink is a Sink that also takes the request's inter-token gaps, in no
// particular order (the first 65,536 of them at most): ObserveGaps is
// called instead of Observe, under the same rules, and must copy gaps to
// keep them.
type GapSink interface {
	Sink
	ObserveGaps(r *Record, gaps []time.Duration)
}
