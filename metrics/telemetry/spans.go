package telemetry

import (
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/encoding/protowire"
)

// The GenAI semantic conventions' attribute names (the
// semantic-conventions-genai repository), and tokentap's own.
const (
	attrOperation      = attribute.Key("gen_ai.operation.name")
	attrProvider       = attribute.Key("gen_ai.provider.name")
	attrRequestModel   = attribute.Key("gen_ai.request.model")
	attrResponseModel  = attribute.Key("gen_ai.response.model")
	attrMaxTokens      = attribute.Key("gen_ai.request.max_tokens")
	attrStream         = attribute.Key("gen_ai.request.stream")
	attrFinishReasons  = attribute.Key("gen_ai.response.finish_reasons")
	attrInputTokens    = attribute.Key("gen_ai.usage.input_tokens")
	attrOutputTokens   = attribute.Key("gen_ai.usage.output_tokens")
	attrTimeFirstChunk = attribute.Key("gen_ai.response.time_to_first_chunk")
	attrTokenType      = attribute.Key("gen_ai.token.type")
	attrServerAddress  = attribute.Key("server.address")
	attrServerPort     = attribute.Key("server.port")
	attrErrorType      = attribute.Key("error.type")
	attrStatus         = attribute.Key("http.response.status_code")
	attrProtocol       = attribute.Key("network.protocol.version")

	attrRoute        = attribute.Key("tokentap.route")
	attrTenant       = attribute.Key("tokentap.tenant")
	attrUpstream     = attribute.Key("tokentap.upstream")
	attrOutcome      = attribute.Key("tokentap.outcome")
	attrQueueMS      = attribute.Key("tokentap.queue_ms")
	attrOverheadMS   = attribute.Key("tokentap.overhead_ms")
	attrClientTTFTMS = attribute.Key("tokentap.client_ttft_ms")
	attrQoE          = attribute.Key("tokentap.qoe")
	attrFluidity     = attribute.Key("tokentap.fluidity")
	attrStallMS      = attribute.Key("tokentap.stall_ms")
	attrStalls       = attribute.Key("tokentap.stalls")
	attrHeldBy       = attribute.Key("tokentap.held_by")
	attrSLOOK        = attribute.Key("tokentap.slo_ok")
	attrRequestID    = attribute.Key("tokentap.request_id")
	attrReason       = attribute.Key("tokentap.failover_reason")
)

// operation is the GenAI operation a request is, from its dialect and
// path.
func operation(r *metrics.Record) string {
	switch r.Dialect {
	case "openai-embeddings":
		return "embeddings"
	case "gemini":
		return "generate_content"
	case "tgi", "llamacpp":
		return "text_completion"
	case "ollama":
		if strings.HasSuffix(r.Path, "/api/generate") {
			return "text_completion"
		}
		return "chat"
	case "openai":
		if strings.HasSuffix(r.Path, "/chat/completions") {
			return "chat"
		}
		return "text_completion"
	}
	return "chat"
}

// provider is the gen_ai.provider.name of a dialect: the conventions' name
// where they have one, the API's otherwise.
func provider(dialect string) string {
	switch dialect {
	case "openai", "openai-responses", "openai-embeddings":
		return "openai"
	case "gemini":
		return "gcp.gemini"
	case "llamacpp":
		return "llama.cpp"
	case "":
		return "generic"
	}
	return dialect
}

// errorType is the record's error.type: "" for a success, else its
// outcome (a low-cardinality name tokentap documents).
func errorType(r *metrics.Record) string {
	if r.Outcome == metrics.OutcomeOK {
		return ""
	}
	return string(r.Outcome)
}

func splitAddr(addr string) (string, int) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr, 0
	}
	p, _ := strconv.Atoi(port)
	return host, p
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// end is when the request's span ends: its last byte delivered.
func end(r *metrics.Record) time.Time {
	if r.E2E >= 0 {
		return r.Start.Add(r.E2E)
	}
	return r.Start
}

// span writes the request's span into the batch, with its attempts as
// child spans when it failed over.
func (e *Exporter) span(r *metrics.Record) {
	tc := &r.Trace
	op := operation(r)
	flags := uint32(flagSampled | flagHasIsRemote)
	b := e.spans.begin()
	b = appendBytes(b, spanTraceID, tc.TraceID[:])
	b = appendBytes(b, spanSpanID, tc.SpanID[:])
	if tc.ParentID != [8]byte{} {
		// A child of the client's span.
		b = appendString(b, spanTraceState, traceState(tc.State))
		b = appendBytes(b, spanParentID, tc.ParentID[:])
		flags |= flagParentsRemote
	}
	b = appendName(b, op, r.Model)
	b = appendVarint(b, spanKind, kindServer)
	b = appendFixed64(b, spanStart, unixNano(r.Start))
	b = appendFixed64(b, spanEnd, unixNano(end(r)))
	e.spans.attrs = spanAttrs(e.spans.attrs[:0], r, op)
	b = appendAttributes(b, e.spans.attrs)
	if r.FinishReason != "" {
		b = appendStringsKeyValue(b, spanAttributes, string(attrFinishReasons), r.FinishReason)
	}
	if r.TTFT >= 0 {
		b = appendEvent(b, "tokentap.first_token", unixNano(r.Start.Add(r.TTFT)))
	}
	if r.TTFA >= 0 {
		b = appendEvent(b, "tokentap.first_answer_token", unixNano(r.Start.Add(r.TTFA)))
	}
	if r.Outcome.Failure() {
		// The service failed it. A request refused for its client's own
		// doing (a 4xx) or whose client left leaves the server span's
		// status unset, as OTel's HTTP conventions ask of 4xx: error.type
		// still says its outcome.
		b = appendErrorStatus(b, r.Error)
	}
	b = appendFixed32(b, spanFlags, flags)
	e.spans.add(b)
	if len(r.Tries) > 0 {
		// The attempts are children of the request's span; they get IDs
		// of their own.
		var last time.Time
		for _, t := range r.Tries {
			e.attempt(tc, op, t.Upstream, t.Addr, t.Start, t.Start.Add(t.Duration), t.Reason)
			last = t.Start.Add(t.Duration)
		}
		e.attempt(tc, op, r.Upstream, r.UpstreamAddr, last, end(r), errorType(r))
	}
}

// traceState is the client's tracestate as the span carries it: "" when
// it is not one.
func traceState(s string) string {
	if s == "" {
		return ""
	}
	ts, err := trace.ParseTraceState(s)
	if err != nil {
		return ""
	}
	return ts.String()
}

// appendName writes the span's name: what it did and to what, "chat
// llama-3", or what it did alone.
func appendName(b []byte, what, to string) []byte {
	if to == "" {
		return appendString(b, spanName, what)
	}
	b = protowire.AppendTag(b, spanName, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(len(what)+1+len(to)))
	b = append(b, what...)
	b = append(b, ' ')
	return append(b, to...)
}

func unixNano(t time.Time) uint64 { return uint64(max(0, t.UnixNano())) }

// spanAttrs appends the request span's attributes to attrs: the GenAI
// conventions' and tokentap's own, but the finish reasons (a list, which
// the span writes itself).
func spanAttrs(attrs []attribute.KeyValue, r *metrics.Record, op string) []attribute.KeyValue {
	attrs = append(attrs, attrOperation.String(op), attrProvider.String(provider(r.Dialect)), attrStream.Bool(r.Stream),
		attrRoute.String(r.Route), attrOutcome.String(string(r.Outcome)), attrRequestID.String(r.RequestID))
	if r.Model != "" {
		attrs = append(attrs, attrRequestModel.String(r.Model))
	}
	if r.ResponseModel != "" {
		attrs = append(attrs, attrResponseModel.String(r.ResponseModel))
	}
	if r.MaxTokens > 0 {
		attrs = append(attrs, attrMaxTokens.Int(r.MaxTokens))
	}
	if r.TokensSource != "" {
		attrs = append(attrs, attrOutputTokens.Int(r.OutputTokens))
	}
	if r.InputTokens > 0 {
		attrs = append(attrs, attrInputTokens.Int(r.InputTokens))
	}
	if r.TTFT >= 0 {
		attrs = append(attrs, attrTimeFirstChunk.Float64(r.TTFT.Seconds()))
	}
	attrs = appendAddr(attrs, r.UpstreamAddr)
	if et := errorType(r); et != "" {
		attrs = append(attrs, attrErrorType.String(et))
	}
	if r.Status > 0 {
		attrs = append(attrs, attrStatus.Int(r.Status))
	}
	switch r.ClientProtocol { // the client's side's, as OTel's HTTP server spans say it
	case "HTTP/2":
		attrs = append(attrs, attrProtocol.String("2"))
	case "HTTP/1.1":
		attrs = append(attrs, attrProtocol.String("1.1"))
	}
	if r.Tenant != "" {
		attrs = append(attrs, attrTenant.String(r.Tenant))
	}
	if r.Upstream != "" {
		attrs = append(attrs, attrUpstream.String(r.Upstream))
	}
	if r.Queue >= 0 {
		attrs = append(attrs, attrQueueMS.Float64(ms(r.Queue)))
	}
	if r.Overhead >= 0 {
		attrs = append(attrs, attrOverheadMS.Float64(ms(r.Overhead)))
	}
	if r.ClientTTFT >= 0 {
		attrs = append(attrs, attrClientTTFTMS.Float64(ms(r.ClientTTFT)))
	}
	if rd := &r.Reading; rd.Tokens > 0 {
		attrs = append(attrs, attrQoE.Float64(rd.QoE), attrFluidity.Float64(rd.Fluidity), attrStallMS.Float64(ms(rd.Stall)), attrStalls.Int(rd.Stalls))
		if rd.HeldBy != metrics.HopNone {
			attrs = append(attrs, attrHeldBy.String(rd.HeldBy.String()))
		}
	}
	if r.SLOJudged {
		attrs = append(attrs, attrSLOOK.Bool(r.SLOMisses == 0))
	}
	return attrs
}

// appendAddr appends server.address and server.port of an upstream's
// host:port.
func appendAddr(attrs []attribute.KeyValue, addr string) []attribute.KeyValue {
	if addr == "" {
		return attrs
	}
	host, port := splitAddr(addr)
	attrs = append(attrs, attrServerAddress.String(host))
	if port > 0 {
		attrs = append(attrs, attrServerPort.Int(port))
	}
	return attrs
}

// attempt writes one attempt against an upstream as a client span, a
// child of the request's (tc).
func (e *Exporter) attempt(tc *metrics.TraceContext, op, upstream, addr string, start, stop time.Time, failure string) {
	var id [8]byte
	putRandom(id[:])
	b := e.spans.begin()
	b = appendBytes(b, spanTraceID, tc.TraceID[:])
	b = appendBytes(b, spanSpanID, id[:])
	b = appendBytes(b, spanParentID, tc.SpanID[:])
	b = appendName(b, "attempt", upstream)
	b = appendVarint(b, spanKind, kindClient)
	b = appendFixed64(b, spanStart, unixNano(start))
	b = appendFixed64(b, spanEnd, unixNano(stop))
	attrs := appendAddr(append(e.spans.attrs[:0], attrOperation.String(op), attrUpstream.String(upstream)), addr)
	if failure != "" {
		attrs = append(attrs, attrErrorType.String(failure))
	}
	e.spans.attrs = attrs
	b = appendAttributes(b, attrs)
	if failure != "" {
		b = appendErrorStatus(b, failure)
	}
	b = appendFixed32(b, spanFlags, flagSampled|flagHasIsRemote)
	e.spans.add(b)
}
