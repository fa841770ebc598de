package metrics

import (
	"sync"

	vm "github.com/VictoriaMetrics/metrics"
)

// Process-wide counters of faults tokentap recovered from. They are not
// tied to a config generation: reloads never reset them.

// Reasons a pooled upstream connection was closed instead of reused.
const (
	DiscardStrayBytes   = "stray_bytes"    // bytes past the end of a response
	DiscardClosedByPeer = "closed_by_peer" // the backend closed it while idle
	DiscardExpired      = "expired"        // idle too long, or past the backend's Keep-Alive limits
	DiscardAfterStream  = "after_stream"   // the backend closes connections after a streamed response (learned)
)

var (
	upstreamDiscarded = map[string]*vm.Counter{
		DiscardStrayBytes:   vm.NewCounter(`tokentap_upstream_conns_discarded_total{reason="stray_bytes"}`),
		DiscardClosedByPeer: vm.NewCounter(`tokentap_upstream_conns_discarded_total{reason="closed_by_peer"}`),
		DiscardExpired:      vm.NewCounter(`tokentap_upstream_conns_discarded_total{reason="expired"}`),
		DiscardAfterStream:  vm.NewCounter(`tokentap_upstream_conns_discarded_total{reason="after_stream"}`),
	}
	upstreamRetries = vm.NewCounter("tokentap_upstream_retries_total")
	acceptErrors    = vm.NewCounter("tokentap_accept_errors_total")
	relayLoopErrors = map[string]*vm.Counter{
		"create": vm.NewCounter(`tokentap_relay_loop_errors_total{op="create"}`),
		"add":    vm.NewCounter(`tokentap_relay_loop_errors_total{op="add"}`),
		"modify": vm.NewCounter(`tokentap_relay_loop_errors_total{op="modify"}`),
		"remove": vm.NewCounter(`tokentap_relay_loop_errors_total{op="remove"}`),
		"wait":   vm.NewCounter(`tokentap_relay_loop_errors_total{op="wait"}`),
	}
	connsRefused = map[string]*vm.Counter{
		"total":  vm.NewCounter(`tokentap_client_conns_refused_total{reason="total"}`),
		"per_ip": vm.NewCounter(`tokentap_client_conns_refused_total{reason="per_ip"}`),
	}
)

// UpstreamConnDiscarded counts a pooled upstream connection closed for
// reason (one of the Discard constants).
func UpstreamConnDiscarded(reason string) { upstreamDiscarded[reason].Inc() }

// UpstreamRetry counts a request sent again on a new connection because the
// backend provably never received it on the first.
func UpstreamRetry() { upstreamRetries.Inc() }

// AcceptError counts a failed accept (out of descriptors, for instance),
// after which the listener backs off and accepts again.
func AcceptError() { acceptErrors.Inc() }

// RelayLoopError counts a relay loop's failed epoll call, by op: create,
// add (the stream stays on its goroutine), modify (the stream ends with
// the error), remove (the slot is never used again), wait.
func RelayLoopError(op string) { relayLoopErrors[op].Inc() }

// ConnRefused counts a client connection closed at once because a cap on
// open connections was reached; reason is "total" or "per_ip".
func ConnRefused(reason string) { connsRefused[reason].Inc() }

// FailedOver counts a request sent on from upstream from of route for
// reason (label values from the config and a fixed list).
func FailedOver(route, from, reason string) {
	vm.GetOrCreateCounter(`tokentap_failovers_total{route="` + route + `",from="` + from + `",reason="` + reason + `"}`).Inc()
}

// BackendScrape counts a scrape of an upstream's metrics_url, by whether
// it answered with a metric tokentap reads.
func BackendScrape(ok bool) {
	if ok {
		scrapesOK.Inc()
	} else {
		scrapesFailed.Inc()
	}
}

var (
	scrapesOK     = vm.NewCounter(`tokentap_backend_scrapes_total{result="ok"}`)
	scrapesFailed = vm.NewCounter(`tokentap_backend_scrapes_total{result="failed"}`)
)

// Shed counts a request of route refused by overload control, on
// upstream ("" for a route of one), at its priority.
func Shed(route, upstream, priority string) {
	vm.GetOrCreateCounter(`tokentap_shed_total{route="` + route + `",upstream="` + upstream + `",priority="` + priority + `"}`).Inc()
}

// ClientConnClosedIdle counts a client connection closed before any byte
// of a request came on it (since it opened, or since its last response):
// the client reset it ("reset"), it stayed idle past its time ("timeout"),
// or its read failed ("error"). Such a connection has no record.
func ClientConnClosedIdle(reason string) { idleCloses[reason].Inc() }

var idleCloses = map[string]*vm.Counter{
	"reset":   vm.NewCounter(`tokentap_client_conns_closed_idle_total{reason="reset"}`),
	"timeout": vm.NewCounter(`tokentap_client_conns_closed_idle_total{reason="timeout"}`),
	"error":   vm.NewCounter(`tokentap_client_conns_closed_idle_total{reason="error"}`),
}

// ShadowSkipped counts a shadow copy of route not sent: max_inflight
// copies were in flight (reason "max_inflight"), or its copy of the body
// would have passed max_buffered_bodies ("body_budget").
func ShadowSkipped(route, reason string) {
	vm.GetOrCreateCounter(`tokentap_shadow_skipped_total{route="` + route + `",reason="` + reason + `"}`).Inc()
}

var (
	otelDropped = map[string]*vm.Counter{
		"records": vm.NewCounter(`tokentap_otel_dropped_total{signal="records"}`),
		"spans":   vm.NewCounter(`tokentap_otel_dropped_total{signal="spans"}`),
	}
	otelExportErrors = map[string]*vm.Counter{
		"traces":  vm.NewCounter(`tokentap_otel_export_errors_total{signal="traces"}`),
		"metrics": vm.NewCounter(`tokentap_otel_export_errors_total{signal="metrics"}`),
	}
	otelSpansExported = vm.NewCounter("tokentap_otel_spans_exported_total")
)

// OTelDropped counts n records ("records": the export queue was full) or
// spans ("spans": their export failed) the collector never got.
func OTelDropped(signal string, n int) { otelDropped[signal].Add(n) }

// OTelExportError counts a failed export of signal ("traces", "metrics").
func OTelExportError(signal string) { otelExportErrors[signal].Inc() }

// OTelSpansExported counts n spans the collector accepted.
func OTelSpansExported(n int) { otelSpansExported.Add(n) }

var (
	tlsHandshakeFailures = vm.NewCounter("tokentap_tls_handshake_failures_total")
	plainHTTPOnTLS       = vm.NewCounter("tokentap_plain_http_on_tls_total")
)

var (
	h2Conns    = vm.NewCounter("tokentap_h2_connections_total")
	h2Requests = vm.NewCounter(`tokentap_client_requests_total{protocol="HTTP/2"}`)
	h1Requests = vm.NewCounter(`tokentap_client_requests_total{protocol="HTTP/1.1"}`)
	h2ErrMu    sync.Mutex
	h2Errs     = map[string]*vm.Counter{}
)

// H2Conn counts a client connection served over HTTP/2.
func H2Conn() { h2Conns.Inc() }

// ClientRequest counts a request by the protocol its client spoke
// ("HTTP/2", else HTTP/1.x).
func ClientRequest(protocol string) {
	if protocol == "HTTP/2" {
		h2Requests.Inc()
		return
	}
	h1Requests.Inc()
}

// H2Error counts a protocol error the HTTP/2 server answered, by kind
// (its own names, a fixed set in its code: "frame_too_large",
// "reset_stream_rapid"…); a name of another shape counts as "other".
func H2Error(kind string) {
	for _, c := range []byte(kind) {
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '_') || len(kind) > 48 {
			kind = "other"
			break
		}
	}
	h2ErrMu.Lock()
	c := h2Errs[kind]
	if c == nil {
		c = vm.GetOrCreateCounter(`tokentap_h2_errors_total{kind="` + kind + `"}`)
		h2Errs[kind] = c
	}
	h2ErrMu.Unlock()
	c.Inc()
}

// PlainHTTPOnTLS counts a plain HTTP request sent to a TLS port (answered
// 400 in plain text; also a failed handshake).
func PlainHTTPOnTLS() { plainHTTPOnTLS.Inc() }

// TLSHandshakeFailed counts a client connection whose TLS handshake failed
// (a client without an acceptable certificate, a protocol mismatch).
func TLSHandshakeFailed() { tlsHandshakeFailures.Inc() }
