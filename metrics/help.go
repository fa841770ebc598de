package metrics

import (
	"bytes"
	"fmt"
	"io"
	"runtime"
	"sync"

	vm "github.com/VictoriaMetrics/metrics"
)

// help is the HELP text of every tokentap family: what it measures and in
// which unit. The metrics library writes "# HELP name" with no text (it
// cannot carry one), so WritePrometheus fills these in. A test checks that
// every tokentap family on /metrics has one.
var help = map[string]string{
	"tokentap_ttft_seconds":           "Time to first token: request arrival to the first token event flushed to the client, in seconds.",
	"tokentap_ttfa_seconds":           "Time to first answer token (text or tool call, not reasoning): request arrival to its flush to the client, in seconds.",
	"tokentap_itl_seconds":            "Inter-token latency: gap between consecutive token events flushed to the client, in seconds.",
	"tokentap_tpot_seconds":           "Time per output token after the first: (E2E - TTFT) / (output tokens - 1), in seconds.",
	"tokentap_e2e_seconds":            "End-to-end time: request arrival to the last response byte flushed to the client, in seconds.",
	"tokentap_queue_seconds":          "Time a request was held by admission control before it was forwarded, in seconds.",
	"tokentap_overhead_seconds":       "Time tokentap itself added before the first token (its own processing on both sides of the relay), in seconds.",
	"tokentap_upstream_ttfb_seconds":  "Upstream time to first byte: request written to the backend to its first response byte, in seconds.",
	"tokentap_server_queue_seconds":   "Time the backend reports it queued the request, in seconds (when the backend reports timings).",
	"tokentap_server_prefill_seconds": "Prompt processing time the backend reports, in seconds (when the backend reports timings).",
	"tokentap_server_decode_seconds":  "Decoding time the backend reports, in seconds (when the backend reports timings).",
	"tokentap_client_ttft_seconds":    "Time to first token as the client lived it, network included: client sent its request to the first token reaching it, in seconds.",
	"tokentap_client_e2e_seconds":     "End-to-end time as the client lived it, network included: client sent its request to the last byte reaching it, in seconds.",

	"tokentap_stream_qoe":           "How each stream read to a reader at its route's pace: 1 when the reader finished by the expected timeline, less when a late first token or stalls pushed it out (streams with tokens).",
	"tokentap_stream_fluidity":      "Share of each stream's tokens that reached the reader by their deadline, the deadlines keeping their slack while tokens are on time (streams with tokens).",
	"tokentap_stream_stall_seconds": "Time each stream's reader waited for tokens that had not come at its pace, added up, in seconds (streams with tokens).",
	"tokentap_stream_stalls_total":  "Streams whose reader waited, by the hop that held the token behind its longest wait (upstream, gateway, client).",

	"tokentap_requests_total":            "Requests finished, by outcome and response status class.",
	"tokentap_output_tokens_total":       "Output tokens produced by the backend (from its usage report, else counted from the stream).",
	"tokentap_input_tokens_total":        "Input (prompt) tokens the backend reported.",
	"tokentap_items_total":               "Results of non-generating calls (embeddings, for instance).",
	"tokentap_slo_judged_requests_total": "Requests judged against an SLO.",
	"tokentap_goodput_requests_total":    "Requests judged against an SLO that met all its objectives.",
	"tokentap_slo_missed_total":          "Requests that missed an objective of their SLO, by objective.",

	"tokentap_tenant_requests_total":      "Requests finished per tenant, by outcome.",
	"tokentap_tenant_output_tokens_total": "Output tokens charged to a tenant.",
	"tokentap_tenant_input_tokens_total":  "Input tokens charged to a tenant.",
	"tokentap_admission_rejected_total":   "Requests refused by admission control per tenant, by reason.",
	"tokentap_tenant_inflight":            "Requests of a tenant admitted and not yet finished.",
	"tokentap_tenant_queue_depth":         "Requests of a tenant waiting in its admission queue.",

	"tokentap_admission_store_up":               "1 while the shared admission store (Redis) answers; 0 from the third failed call in a row (the breaker: decisions no longer wait for it) until a probe is answered.",
	"tokentap_admission_store_calls":            "Calls made to the shared admission store since start.",
	"tokentap_admission_store_call_failures":    "Calls to the shared admission store that failed or ran past its timeout, since start.",
	"tokentap_admission_store_call_seconds":     "Time spent in calls to the shared admission store since start, in seconds.",
	"tokentap_admission_store_replicas":         "Replicas sharing the admission store, from their heartbeats.",
	"tokentap_stats_groups":                     "Groups (route × model × tenant × upstream × class) the live /stats table holds, at most measurement.max_groups and the fold groups.",
	"tokentap_stats_requests_folded":            "Requests the live /stats table recorded in their route's (folded) tenant because it held measurement.max_groups groups, since start.",
	"tokentap_stats_groups_evicted":             "Groups the live /stats table evicted after an hour without a request (their all-time figures folded into the (folded) tenant), since start.",
	"tokentap_admission_store_releases_pending": "Releases of finished requests not yet confirmed by the shared admission store (sent in the background, pipelined).",
	"tokentap_admission_store_releases_dropped": "Releases never sent since start: the shared admission store stayed down past the 4 minutes a release is sent again for; their leases ran out on their own, their unused tokens stayed taken.",
	"tokentap_admission_store_releases_retried": "Releases that could not be sent to the shared admission store at once (it was down, or a call failed) and were kept to be sent again, since start.",

	"tokentap_upstream_conns_discarded_total":    "Pooled upstream connections closed instead of reused, by reason.",
	"tokentap_upstream_retries_total":            "Requests sent again on a new connection because the backend provably never received them.",
	"tokentap_relay_loop_errors_total":           "Failed epoll calls of the relay loops, by op (add: the stream stayed on its goroutine; modify: the stream ended; remove: the slot retired).",
	"tokentap_accept_errors_total":               "Failed accepts of client connections (the listener backs off and goes on).",
	"tokentap_client_conns_refused_total":        "Client connections closed at once because a connection cap was reached, by cap.",
	"tokentap_plain_http_on_tls_total":           "Plain HTTP requests sent to a TLS port, answered 400 in plain text (also counted as failed handshakes).",
	"tokentap_h2_connections_total":              "Client connections served over HTTP/2 (h2 by ALPN, or h2c with prior knowledge).",
	"tokentap_client_requests_total":             "Requests by the protocol their client spoke (HTTP/1.1, HTTP/2).",
	"tokentap_h2_errors_total":                   "HTTP/2 protocol errors the server answered (a stream or the connection reset), by kind.",
	"tokentap_tls_handshake_failures_total":      "Client connections whose TLS handshake failed (no acceptable certificate, no common protocol version or cipher).",
	"tokentap_failovers_total":                   "Requests sent on to a route's next upstream, by the upstream that failed and why.",
	"tokentap_client_conns_closed_idle_total":    "Client connections closed before any byte of a request came (since they opened or since their last response), by reason: reset by the client, timeout (idle past idle_timeout, or request_read_timeout on a new connection), error. They have no record.",
	"tokentap_backend_scrapes_total":             "Scrapes of upstreams' metrics_url, by result (ok: a metric tokentap reads was in it; failed: no answer, an error status or nothing it reads).",
	"tokentap_cost_usd_total":                    "What requests cost at their model's price (prices), in dollars, by route, model and tenant.",
	"tokentap_models_folded_total":               "Requests whose model was labelled other on their route: past the allowlist, the route's literal models and the first models.per_route it labelled (or not a plain model name).",
	"tokentap_usage_rejected_total":              "Responses whose usage could not be true (a count negative, fractional, not a number, or past what the request's and response's bytes and time could carry), set aside for tokentap's own count, by route.",
	"tokentap_unpriced_requests_total":           "Requests whose served model has no price (prices), by route; charged=route_max: charged at the route's dearest price (the tenant has a dollar budget), charged=no: no cost recorded.",
	"tokentap_cached_tokens_total":               "Input tokens the backends served from their prompt caches, as their usage reported, by route and model.",
	"tokentap_cache_write_tokens_total":          "Input tokens the backends wrote to their prompt caches (Anthropic's cache_creation_input_tokens), by route and model.",
	"tokentap_cache_reported_requests_total":     "Streamed requests whose backend said how many input tokens its prompt cache served, by route and cache (hit: some, miss: none).",
	"tokentap_cache_reported_ttft_seconds_total": "The first tokens of those requests, in seconds summed, by route and cache: over the requests, the mean TTFT with a prompt-cache hit and without.",
	"tokentap_shed_total":                        "Requests refused by overload control (outcome shed): their upstream was predicted to serve them past their objectives, by route, upstream and priority.",
	"tokentap_shadow_skipped_total":              "Shadow copies not sent: max_inflight copies were in flight (reason max_inflight), or the copy of the request body would have passed max_buffered_bodies (body_budget).",
	"tokentap_guard_tripped":                     "1 while the canary guard has taken the candidate upstream out of the split, else 0.",

	"tokentap_access_log_dropped_total":      "Access log lines dropped because the log's queue was full.",
	"tokentap_access_log_write_errors_total": "Failed writes to the access log (retried).",
	"tokentap_access_log_reopens_total":      "Times the access log file was reopened (after rotation).",

	"tokentap_otel_dropped_total":        "OpenTelemetry data the collector never got: records dropped because the export queue was full (signal records); spans dropped because the span queue was full, or in exports that failed (signal spans).",
	"tokentap_otel_export_errors_total":  "OpenTelemetry exports that failed or timed out, by signal.",
	"tokentap_otel_spans_exported_total": "Spans the collector accepted.",

	"tokentap_build_info": "Always 1; its labels are the running build's version, Go version and VCS revision.",
}

// SetBuildInfo publishes tokentap_build_info{version, go_version, revision}
// 1. Call it once, at start.
func SetBuildInfo(version, revision string) {
	vm.GetOrCreateGauge(fmt.Sprintf(`tokentap_build_info{version=%q,go_version=%q,revision=%q}`, version, runtime.Version(), revision),
		func() float64 { return 1 })
}

var exposition = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// WritePrometheus writes every registered metric in Prometheus's text
// format, with the HELP text of each tokentap family (process metrics
// included when process is true).
func WritePrometheus(w io.Writer, process bool) {
	b := exposition.Get().(*bytes.Buffer)
	defer exposition.Put(b)
	b.Reset()
	vm.WritePrometheus(b, process)
	_, _ = w.Write(withHelp(b.Bytes()))
}

var helpPrefix = []byte("# HELP ")

// withHelp returns text with the help text added to each bare "# HELP
// family" line of a tokentap family.
func withHelp(text []byte) []byte {
	out := make([]byte, 0, len(text)+len(text)/8)
	for len(text) > 0 {
		line := text
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line, text = text[:i+1], text[i+1:]
		} else {
			text = nil
		}
		name, ok := bytes.CutPrefix(bytes.TrimRight(line, "\n"), helpPrefix)
		if h := help[string(name)]; ok && h != "" && bytes.IndexByte(name, ' ') < 0 {
			out = append(out, helpPrefix...)
			out = append(out, name...)
			out = append(out, ' ')
			out = append(out, h...)
			out = append(out, '\n')
			continue
		}
		out = append(out, line...)
	}
	return out
}
