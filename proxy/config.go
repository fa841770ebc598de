package proxy

import (
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/admission"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/ratelimit"
	"go.uber.org/zap"
)

// Upstream is one backend of a route with several, Guard a canary's guard
// (proxy/routing); GuardStatus and GuardState are what the admin listener
// shows of one.
type (
	Upstream    = routing.Upstream
	Guard       = routing.Guard
	GuardStatus = routing.GuardStatus
	GuardState  = routing.GuardState
)

// Balance policies and prefix stickiness (proxy/routing).
const (
	BalanceWeighted      = routing.BalanceWeighted
	BalanceLeastInflight = routing.BalanceLeastInflight
	BalanceLeastTTFT     = routing.BalanceLeastTTFT
	StickyPrefix         = routing.StickyPrefix
)

// Overload is a route's overload control, Priority a request's place
// under it (proxy/admission).
type (
	Overload = admission.Overload
	Priority = admission.Priority
)

// The priorities, most important first.
const (
	PriorityCritical  = admission.PriorityCritical
	PriorityStandard  = admission.PriorityStandard
	PrioritySheddable = admission.PrioritySheddable
)

// ParsePriority reads a priority's name.
func ParsePriority(s string) (Priority, bool) { return admission.ParsePriority(s) }

// Header is a header set on every request to an upstream (its
// credentials); UpstreamTLS is how https upstreams are trusted
// (proxy/upstream).
type (
	Header      = upstream.Header
	UpstreamTLS = upstream.TLS
)

// Timeouts bound the upstream side of an exchange (upstream.Timeouts);
// DefaultTimeouts are those used where the config says nothing.
type Timeouts = upstream.Timeouts

// DefaultTimeouts are the timeouts used where the config says nothing.
var DefaultTimeouts = upstream.DefaultTimeouts

// Pace is what a route's streams are read against (Route.QoE): the first
// token due TTFT after the request's start, then a token every Read.
type Pace = measure.Pace

// Route sends requests whose path starts with Prefix to Upstream.
type Route struct {
	// Name labels the route's metrics and records.
	Name string
	// Prefix is the path prefix the route matches; the longest match wins.
	Prefix string
	// Models are the models the route serves (globs: * any run, ? one
	// character), matched against the model a request names; routes that
	// name models may share a prefix (models.go). Empty: every model.
	Models []string
	// Upstream is the backend's base URL (http or https); a path in it is
	// put in front of the request path.
	Upstream string
	// Upstreams are several backends instead of Upstream: each request
	// goes to one, chosen by Balance and Sticky, and each is measured
	// apart (records, /stats and metrics carry its name as upstream).
	Upstreams []Upstream
	// Balance is BalanceWeighted (default), BalanceLeastInflight or
	// BalanceLeastTTFT.
	Balance string
	// Sticky keeps a user on one upstream: "tenant", or "header:NAME"
	// (the value of that request header); or a prompt's prefix on the
	// upstream whose cache holds it: StickyPrefix; empty: none.
	Sticky string
	// Guard stops a canary upstream that is worse than its baseline.
	Guard *Guard
	// Failover sends a failed request to the route's next upstream.
	Failover *Failover
	// Shadow copies a share of requests to another upstream, measured
	// and discarded.
	Shadow *Shadow
	// StripPrefix removes Prefix from the path before forwarding.
	StripPrefix bool
	// Dialect names the API the route speaks (see dialect.All); empty means
	// chosen per request from the path.
	Dialect string
	// InjectUsage asks the upstream for usage on OpenAI streaming requests
	// that do not (stream_options.include_usage) and removes the usage chunk
	// this adds from what the client receives: the one case where tokentap
	// changes the bytes it relays.
	InjectUsage bool
	// Timeouts for this route's upstream.
	Timeouts Timeouts
	// WebSocket relays WebSocket upgrades (the OpenAI Realtime API): the
	// upstream's 101, then bytes both ways until either side closes, with
	// a record of the bytes each way and the session's length. Without
	// it an upgrade is answered 400.
	WebSocket bool
	// TLS is how the route's https upstreams are trusted and how tokentap
	// presents itself to them (nil: the system's roots, no certificate).
	TLS *UpstreamTLS
	// SLO is the route's objectives, over Config.SLO key by key.
	SLO metrics.SLO
	// QoE is what its streams are read against (Record.Reading): set
	// times win, then the SLO's TTFT and TPOT objectives, then
	// measure.DefaultPace.
	QoE Pace
	// Overload refuses requests that the upstream would serve too late
	// (nil: every request is forwarded). See Overload.
	Overload *Overload
	// Headers are set on every request sent to the route's upstreams:
	// the backend's credentials (proxy/upstream). ForwardClientKey sends
	// the client's key headers on where tenants are known by key, which
	// drops them otherwise (they are tokentap's keys, not the backend's).
	Headers          []Header
	ForwardClientKey bool
}

// Config is one generation of the proxy's configuration.
type Config struct {
	Routes []Route
	// Prices are the models' prices (the first whose glob matches): each
	// record's CostUSD.
	Prices []Price
	// Models is the model allowlist: metric label values for models, on
	// every route. Each route also labels the models its globs name
	// literally, and the first ModelsPerRoute others it sees
	// (metrics.SetOptions.PerRoute: 0 the default, 8; -1 none); every
	// other model is labelled "other", and counted.
	Models         []string
	ModelsPerRoute int
	// EnforceModels refuses (400) requests naming a model not in Models.
	EnforceModels bool
	// MaxEventBytes bounds the bytes kept of one SSE event or NDJSON line, and
	// of a non-streamed body read for its usage.
	MaxEventBytes int
	// MaxDecodedBytes bounds the bytes of a compressed response decoded
	// for measuring (default 64 MiB): past it the response still passes
	// untouched, and its record is marked partial. A compression bomb costs
	// no more than decoding this much.
	MaxDecodedBytes int64
	// Admission is the admission control; nil means off.
	Admission *ratelimit.Config
	// Classes sorts requests for comparisons of like with like (the class
	// label of /stats, the verdict per class, a guard limited to one).
	Classes Classes
	// DefaultMaxOutput is the output a request reserves of its token budget
	// when it declares no limit (default 1024).
	DefaultMaxOutput int
	// SLO is the default objectives of every route; a route's SLO and then
	// the tenant's (TenantSLOs) override it key by key. Every finished
	// request of a route with objectives is judged (metrics.SLO.Judge).
	SLO metrics.SLO
	// TenantSLOs are per-tenant overrides, by admission tenant name.
	TenantSLOs map[string]metrics.SLO
	// Buckets overrides metrics.DefaultBuckets per measure.
	Buckets map[string][]float64
	// Warn sets the thresholds of the /stats warnings.
	Warn stats.WarnOptions
	// TenantPriorities are the highest priority each tenant's requests
	// may claim (overload control; absent: standard).
	TenantPriorities map[string]Priority
	// StatsMaxGroups bounds the groups of the live /stats table (0:
	// stats.DefaultMaxGroups); past it requests fold into their route's
	// group of stats.FoldedTenant.
	StatsMaxGroups int
}

// Price is what a model's tokens cost (measure.Price); Classes sorts
// requests for comparisons of like with like (measure.Classes).
type (
	Price   = measure.Price
	Classes = measure.Classes
)

// FieldError is a configuration error: the field at fault, as the path of
// its key in tokentap's config file (routes[2].prefix), and what is wrong.
// Admission errors are ratelimit.FieldError, alike.
type FieldError = conf.FieldError

// Defaults, in one place: what a zero field of Config or Options means.
const (
	defaultMaxEventBytes      = 1 << 20
	defaultMaxDecodedBytes    = 64 << 20
	defaultMaxOutput          = 1024
	defaultMaxRequestBodySize = 32 << 20
	defaultMaxBufferedBodies  = 512 << 20
	defaultClientWriteTimeout = 60 * time.Second
	defaultRequestReadTimeout = 2 * time.Minute
	defaultIdleTimeout        = 2 * time.Minute
)

// withDefaults returns c with its zero fields set to their defaults.
func (c Config) withDefaults() Config {
	if c.MaxEventBytes == 0 {
		c.MaxEventBytes = defaultMaxEventBytes
	}
	if c.MaxDecodedBytes == 0 {
		c.MaxDecodedBytes = defaultMaxDecodedBytes
	}
	if c.DefaultMaxOutput == 0 {
		c.DefaultMaxOutput = defaultMaxOutput
	}
	c.Classes = c.Classes.WithDefaults()
	return c
}

// Failover sends a request whose upstream failed before any response byte
// reached the client to the route's next upstream: at most once to each,
// never after a byte went to the client, never for a client that left.
type Failover struct {
	// On lists the failures that fail over: FailoverConnect (the upstream
	// could not be reached), FailoverStatus5xx (it answered 5xx),
	// FailoverFirstToken (no body byte within FirstTokenTimeout of the
	// request written).
	On []string
	// FirstTokenTimeout bounds the wait for the first byte of the body: a
	// backend queueing too long is cut (closing its connection cancels the
	// work) and the next one tried. The response headers are held back
	// until then, so a failover is never seen by the client.
	FirstTokenTimeout time.Duration
}

// The failures a route can fail over on.
const (
	FailoverConnect    = "connect"
	FailoverStatus5xx  = "status_5xx"
	FailoverFirstToken = "first_token_timeout"
)

func (f *Failover) on(reason string) bool { return f != nil && slices.Contains(f.On, reason) }

// Shadow sends a copy of a sampled share of a route's requests to another
// of its upstreams, reads and measures the copy's response fully, and
// discards it. The client's request never waits for its shadow: the copy
// is sent from a goroutine of its own once the request is admitted.
type Shadow struct {
	// Upstream names one of the route's upstreams (usually of weight 0).
	Upstream string
	// Sample is the share of requests copied (0 … 1).
	Sample float64
	// MaxInflight bounds the copies in flight; beyond it a copy is
	// skipped and counted (tokentap_shadow_skipped_total).
	MaxInflight int
	// Timeout bounds a copy's whole life, from its send to its response's
	// end (default DefaultShadowTimeout): a stalled shadow upstream holds
	// its copy of the body against max_buffered_bodies, and a place among
	// MaxInflight, no longer, where the route's first-byte timeout (10
	// minutes) would hold them.
	Timeout time.Duration
}

// DefaultShadowTimeout is a shadow copy's life when Shadow.Timeout is 0.
const DefaultShadowTimeout = time.Minute

// withDefaults returns s with its zero fields set to their defaults.
func (s Shadow) withDefaults() Shadow {
	if s.MaxInflight == 0 {
		s.MaxInflight = 16
	}
	if s.Timeout == 0 {
		s.Timeout = DefaultShadowTimeout
	}
	return s
}

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
