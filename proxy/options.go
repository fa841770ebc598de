package proxy

import (
	"time"

	"github.com/tokentap/tokentap/metrics"
	"go.uber.org/zap"
)

// Options are the parts of a Proxy that are not configuration.
type Options struct {
	// Sinks receive every finished record, after the metrics set.
	Sinks []metrics.Sink
	// Logger for errors of tokentap itself (not per-request failures,
	// which are counted and logged in the access log). Nil: no logging.
	Logger *zap.Logger
	// Now is the clock; nil means time.Now. Every time reading of the proxy
	// goes through it.
	Now func() time.Time
	// MaxRequestBodySize bounds a request body (default 32 MiB).
	MaxRequestBodySize int
	// MaxBufferedBodies bounds the request body bytes all requests hold
	// from the first byte read to the response's end (default 512 MiB): a request whose body
	// would pass it gets 503 at once. Slow clients part-way through large
	// bodies cannot add up to more.
	MaxBufferedBodies int64
	// ClientWriteTimeout bounds each write to a client, so a client that
	// stops reading cannot hold a stream forever (default 60 s).
	ClientWriteTimeout time.Duration
	// MaxConns caps the open client connections (0: no cap); beyond it a
	// new connection is answered 503 and closed. MaxConnsPerIP caps them
	// per client address (0: no cap).
	MaxConns, MaxConnsPerIP int
	// StatsNow is the clock of the live percentile windows (nil: Now).
	StatsNow func() time.Time
	// RequestReadTimeout bounds reading a request's headers and body, and
	// IdleTimeout the wait for the next request on a keep-alive connection
	// (default 2 min each).
	RequestReadTimeout, IdleTimeout time.Duration
	// GoroutineRelay keeps every streamed body on its request's goroutine
	// instead of handing established chunked streams to the relay loops
	// (relayplane). The loops cost less per event; this is the path to compare
	// them against.
	GoroutineRelay bool
	// NoStats, NoSeries and NoClientSide turn measuring features off
	// (measurement: in the config), each with what it costs: the live
	// /stats table (StatsOff: the admin answers 404), the per-request
	// Prometheus series of each route (latency histograms, goodput and
	// outcome counters), and the client side's TCP_INFO readings at each
	// response's end with the wait for the client's ACK and the marks of
	// the first tokens' acknowledgement (the record's client_* fields and
	// bytes_acked are then absent).
	NoStats, NoSeries, NoClientSide bool
	// Tracer starts each request's trace (nil: no tracing, and a client's
	// traceparent passes through untouched). The upstream request then
	// carries tokentap's span in traceparent, and the record its trace
	// context, the response's model and finish reason and the failed
	// attempts, for a Sink to export.
	Tracer Tracer
}

// Tracer starts a request's trace from the client's traceparent and
// tracestate (nil when absent): the context of tokentap's span for the
// request, its IDs chosen now so the upstream request can carry them, and
// whether it is sampled. It must be safe for concurrent use and fast: it
// runs on every request.
type Tracer interface {
	StartTrace(traceparent, tracestate []byte) metrics.TraceContext
}

// withDefaults returns o with its zero fields set to their defaults.
func (o Options) withDefaults() Options {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	if o.MaxRequestBodySize <= 0 {
		o.MaxRequestBodySize = defaultMaxRequestBodySize
	}
	if o.MaxBufferedBodies <= 0 {
		o.MaxBufferedBodies = defaultMaxBufferedBodies
	}
	if o.ClientWriteTimeout <= 0 {
		o.ClientWriteTimeout = defaultClientWriteTimeout
	}
	if o.RequestReadTimeout <= 0 {
		o.RequestReadTimeout = defaultRequestReadTimeout
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = defaultIdleTimeout
	}
	return o
}
