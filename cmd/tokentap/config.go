package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics/telemetry"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/ratelimit"
	"go.yaml.in/yaml/v3"
)

// fileConfig is the YAML file's schema. Every field is documented in
// configs/tokentap.yaml, which a test loads so it never rots.
type fileConfig struct {
	Listen    string        `yaml:"listen"`
	Admin     fileAdmin     `yaml:"admin"`
	AccessLog *string       `yaml:"access_log"` // nil: not in the file; "": disabled
	Upstream  string        `yaml:"upstream"`
	Routes    []fileRoute   `yaml:"routes"`
	Prices    []filePrice   `yaml:"prices"`
	Models    fileModels    `yaml:"models"`
	Timeouts  fileTimeouts  `yaml:"timeouts"`
	Limits    fileLimits    `yaml:"limits"`
	Tenants   []fileTenant  `yaml:"tenants"`
	Admission fileAdmission `yaml:"admission"`
	SLO       *fileSLO      `yaml:"slo"`
	Metrics   fileMetrics   `yaml:"metrics"`
	Warnings  fileWarnings  `yaml:"warnings"`
	Classes   fileClasses   `yaml:"classes"`
	// DrainTimeout bounds the drain at shutdown; DrainDelay is how long
	// /readyz says 503 before the listener closes.
	DrainTimeout duration `yaml:"drain_timeout"`
	DrainDelay   duration `yaml:"drain_delay"`
	// Relay says who relays established streams: "loop" (the epoll relay
	// loops, the default) or "goroutine" (each stream on its request's
	// goroutine).
	Relay string `yaml:"relay"`
	// Measurement turns measuring features off, each on by default.
	Measurement fileMeasurement `yaml:"measurement"`
	// TLS serves the proxy listener over TLS (nil: plain).
	TLS *fileTLS `yaml:"tls"`
	// OTel exports spans and GenAI metrics to an OpenTelemetry collector
	// (nil: off).
	OTel  *fileOTel      `yaml:"otel"`
	lines map[string]int // field path → line, for validation errors
}

// fileMeasurement is the measurement section: what tokentap measures
// besides each request's record, its access log line and its OTel
// export; each is on unless set false.
type fileMeasurement struct {
	Stats      *bool `yaml:"stats"`       // the live /stats table (and the dashboard's data)
	Series     *bool `yaml:"series"`      // the routes' per-request Prometheus series
	ClientSide *bool `yaml:"client_side"` // TCP_INFO at each response's end, the wait for the client's ACK
	// MaxGroups bounds the live table's route × model × tenant × upstream
	// × class groups (default 2,000; about 9 KB each once used).
	MaxGroups int `yaml:"max_groups"`
}

// off says a switch of the measurement section was set false.
func off(b *bool) bool { return b != nil && !*b }

// fileOTel is the otel section: present, it turns the export on.
type fileOTel struct {
	Endpoint    string   `yaml:"endpoint"`
	ServiceName string   `yaml:"service_name"`
	Traces      *bool    `yaml:"traces"`  // default true
	Metrics     *bool    `yaml:"metrics"` // default true
	Sample      *float64 `yaml:"sample"`  // default 1
	// HeadersFile holds headers sent with every export, one key=value a
	// line (a collector's credentials kept out of the config).
	HeadersFile string `yaml:"headers_file"`
	// Queue bounds the finished records waiting to be exported (default
	// 8192); past it they are dropped and counted.
	Queue int `yaml:"queue"`
	// Semconv names the GenAI client metrics: default (today's), latest
	// (semantic-conventions-genai v0.1.0's) or both.
	Semconv string `yaml:"semconv"`
}

// fileAdmin is the admin listener: an address, or a mapping with the
// address and the file holding the bearer token every admin endpoint but
// /healthz and /readyz requires. An empty address turns the listener off.
type fileAdmin struct {
	Listen    string `yaml:"listen"`
	TokenFile string `yaml:"token_file"`
	// Hosts are the names, besides IP literals and localhost, that
	// requests without a token may carry in Host.
	Hosts []string `yaml:"hosts"`
	// TLS serves the admin listener over TLS (nil: plain).
	TLS *fileTLS `yaml:"tls"`
	set bool     // the file gives an address ("" included)
}

// fileTLS is a listener's TLS: its certificate and key, the CAs of the
// clients' certificates (mTLS), the lowest version ("1.2", "1.3").
type fileTLS struct {
	CertFile     string `yaml:"cert_file"`
	KeyFile      string `yaml:"key_file"`
	ClientCAFile string `yaml:"client_ca_file"`
	MinVersion   string `yaml:"min_version"`
}

// fileUpstreamTLS is a route's TLS towards its https upstreams.
type fileUpstreamTLS struct {
	CAFile             string `yaml:"ca_file"`
	CertFile           string `yaml:"cert_file"`
	KeyFile            string `yaml:"key_file"`
	ServerName         string `yaml:"server_name"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
}

func (u *fileUpstreamTLS) upstreamTLS() *proxy.UpstreamTLS {
	if u == nil {
		return nil
	}
	return &proxy.UpstreamTLS{CAFile: u.CAFile, CertFile: u.CertFile, KeyFile: u.KeyFile, ServerName: u.ServerName,
		InsecureSkipVerify: u.InsecureSkipVerify}
}

func (a *fileAdmin) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		a.Listen, a.set = n.Value, true
		return nil
	}
	if n.Kind != yaml.MappingNode {
		return &nodeError{line: n.Line, column: n.Column, msg: "is neither an address nor a mapping with listen and token_file"}
	}
	// Node.Decode would not refuse unknown keys: check them here.
	for i := 0; i+1 < len(n.Content); i += 2 {
		switch k, v := n.Content[i], n.Content[i+1]; k.Value {
		case "listen":
			a.Listen, a.set = v.Value, true
		case "token_file":
			a.TokenFile = v.Value
		case "hosts":
			if err := v.Decode(&a.Hosts); err != nil {
				return &nodeError{line: v.Line, column: v.Column, msg: "must be a list of host names"}
			}
		case "tls":
			if v.Kind != yaml.MappingNode {
				return &nodeError{line: v.Line, column: v.Column, msg: "must be a mapping with cert_file and key_file"}
			}
			for j := 0; j+1 < len(v.Content); j += 2 {
				switch k := v.Content[j]; k.Value {
				case "cert_file", "key_file", "client_ca_file", "min_version":
				default:
					return &nodeError{line: k.Line, column: k.Column, msg: "unknown field " + k.Value}
				}
			}
			a.TLS = &fileTLS{}
			if err := v.Decode(a.TLS); err != nil {
				return &nodeError{line: v.Line, column: v.Column, msg: "must be a mapping with cert_file and key_file"}
			}
		default:
			return &nodeError{line: k.Line, column: k.Column, msg: "unknown field " + k.Value}
		}
	}
	return nil
}

type fileRoute struct {
	Name        string        `yaml:"name"`
	Prefix      string        `yaml:"prefix"`
	Models      []string      `yaml:"models"`
	Upstream    string        `yaml:"upstream"`
	StripPrefix bool          `yaml:"strip_prefix"`
	Dialect     string        `yaml:"dialect"`
	InjectUsage bool          `yaml:"inject_usage"`
	WebSocket   bool          `yaml:"websocket"`
	Timeouts    *fileTimeouts `yaml:"timeouts"`
	SLO         *fileSLO      `yaml:"slo"`
	// QoE is what the route's streams are read against: the first token
	// due ttft after the start, then a token every pace.
	QoE *fileQoE `yaml:"qoe"`
	// Upstreams are several backends instead of upstream, split by
	// balance and sticky.
	Upstreams []fileUpstream `yaml:"upstreams"`
	Balance   string         `yaml:"balance"`
	Sticky    string         `yaml:"sticky"`
	Guard     *fileGuard     `yaml:"guard"`
	Failover  *fileFailover  `yaml:"failover"`
	Shadow    *fileShadow    `yaml:"shadow"`
	Overload  *fileOverload  `yaml:"overload"`
	// TLS is how the route's https upstreams are trusted, and the client
	// certificate tokentap presents to them.
	TLS *fileUpstreamTLS `yaml:"tls"`
	// Headers are set on every request to the route's upstreams (the
	// backend's credentials: ${env:NAME}, ${file:PATH}); ForwardClientKey
	// sends on the client's key where tenants are known by it.
	Headers          map[string]string `yaml:"headers"`
	ForwardClientKey bool              `yaml:"forward_client_key"`
}

// upstreams returns the route's several upstreams (weight 1 when unset),
// route i's, their headers read.
func (r *fileRoute) upstreams(i int) ([]proxy.Upstream, error) {
	var out []proxy.Upstream
	for j, u := range r.Upstreams {
		w := 1
		if u.Weight != nil {
			w = *u.Weight
		}
		hs, err := headers(u.Headers, fmt.Sprintf("routes[%d].upstreams[%d].headers", i, j))
		if err != nil {
			return nil, err
		}
		out = append(out, proxy.Upstream{Name: u.Name, URL: u.URL, Weight: w, MetricsURL: u.MetricsURL, Headers: hs, Protocol: u.Protocol})
	}
	return out, nil
}

func (f *fileShadow) shadow() *proxy.Shadow {
	if f == nil {
		return nil
	}
	return &proxy.Shadow{Upstream: f.Upstream, Sample: float64(f.Sample), MaxInflight: f.MaxInflight, Timeout: f.Timeout.d}
}

func (f *fileFailover) failover() *proxy.Failover {
	if f == nil {
		return nil
	}
	return &proxy.Failover{On: f.On, FirstTokenTimeout: f.FirstTokenTimeout.d}
}

func (f *fileGuard) guard() *proxy.Guard {
	if f == nil {
		return nil
	}
	return &proxy.Guard{Candidate: f.Candidate, Baseline: f.Baseline, Class: f.Class, Window: f.Window, MinRequests: f.MinRequests, MinKeys: f.MinKeys,
		MaxTTFTP95Increase: float64(f.MaxTTFTP95Increase), MaxE2EP95Increase: float64(f.MaxE2EP95Increase),
		MaxErrorRateIncrease: float64(f.MaxErrorRateIncrease)}
}

// fileOverload is a route's overload control (proxy.Overload).
type fileOverload struct {
	Shed                bool   `yaml:"shed"`
	PriorityHeader      string `yaml:"priority_header"`
	TrustPriorityHeader bool   `yaml:"trust_priority_header"`
	SLOHeaders          bool   `yaml:"slo_headers"`
}

func (f *fileOverload) overload() *proxy.Overload {
	if f == nil {
		return nil
	}
	return &proxy.Overload{Shed: f.Shed, PriorityHeader: f.PriorityHeader, TrustPriorityHeader: f.TrustPriorityHeader, SLOHeaders: f.SLOHeaders}
}

// fileShadow is a route's shadow traffic.
type fileShadow struct {
	Upstream    string   `yaml:"upstream"`
	Sample      share    `yaml:"sample"`
	MaxInflight int      `yaml:"max_inflight"`
	Timeout     duration `yaml:"timeout"`
}

// fileFailover is a route's failover.
type fileFailover struct {
	On                []string `yaml:"on"`
	FirstTokenTimeout duration `yaml:"first_token_timeout"`
}

// fileClasses are the thresholds of the request classes.
type fileClasses struct {
	InputTokens  []int `yaml:"input_tokens"`
	OutputTokens int   `yaml:"output_tokens"`
}

// fileGuard is a route's canary guard.
type fileGuard struct {
	Candidate            string   `yaml:"candidate"`
	Baseline             string   `yaml:"baseline"`
	Class                string   `yaml:"class"`
	Window               string   `yaml:"window"`
	MinRequests          int64    `yaml:"min_requests"`
	MinKeys              int      `yaml:"min_keys"`
	MaxTTFTP95Increase   increase `yaml:"max_ttft_p95_increase"`
	MaxE2EP95Increase    increase `yaml:"max_e2e_p95_increase"`
	MaxErrorRateIncrease share    `yaml:"max_error_rate_increase"`
}

// fileUpstream is one of a route's upstreams; weight defaults to 1.
type fileUpstream struct {
	Name       string            `yaml:"name"`
	URL        string            `yaml:"url"`
	Weight     *int              `yaml:"weight"`
	MetricsURL string            `yaml:"metrics_url"`
	Headers    map[string]string `yaml:"headers"`
	Protocol   string            `yaml:"protocol"`
}

// filePrice is one model's prices, in dollars per million tokens;
// cached_input and cache_write cost as input when left out.
type filePrice struct {
	Model       string   `yaml:"model"`
	Input       float64  `yaml:"input"`
	CachedInput *float64 `yaml:"cached_input"`
	CacheWrite  *float64 `yaml:"cache_write"`
	Output      float64  `yaml:"output"`
}

// prices returns the file's prices (−1: left out).
func prices(ps []filePrice) []proxy.Price {
	var out []proxy.Price
	opt := func(v *float64) float64 {
		if v == nil {
			return -1
		}
		return *v
	}
	for _, p := range ps {
		out = append(out, proxy.Price{Model: p.Model, Input: p.Input, CachedInput: opt(p.CachedInput), CacheWrite: opt(p.CacheWrite), Output: p.Output})
	}
	return out
}

// fileSLO is a set of objectives; each key is optional.
type fileSLO struct {
	TTFT   duration `yaml:"ttft"`
	TTFA   duration `yaml:"ttfa"`
	TPOT   duration `yaml:"tpot"`
	E2E    duration `yaml:"e2e"`
	Target share    `yaml:"target"`
	// Measure: client (default: the client's times, network included,
	// where the record has them) or proxy (tokentap's own marks).
	Measure string `yaml:"measure"`
	// QoE is the least reading score of a good stream (0.9 or 90%).
	QoE share `yaml:"qoe"`
}

func (f *fileSLO) slo() metrics.SLO {
	if f == nil {
		return metrics.SLO{}
	}
	return metrics.SLO{TTFT: f.TTFT.d, TTFA: f.TTFA.d, TPOT: f.TPOT.d, E2E: f.E2E.d, Target: float64(f.Target), Measure: f.Measure, QoE: float64(f.QoE)}
}

// fileQoE is a route's reading pace; each key is optional.
type fileQoE struct {
	TTFT duration `yaml:"ttft"`
	Pace duration `yaml:"pace"`
}

func (f *fileQoE) pace() proxy.Pace {
	if f == nil {
		return proxy.Pace{}
	}
	return proxy.Pace{TTFT: f.TTFT.d, Read: f.Pace.d}
}

// fileMetrics holds the bucket bounds per measure, in seconds.
type fileMetrics struct {
	Buckets map[string][]float64 `yaml:"buckets"`
}

// fileWarnings are the thresholds of /stats warnings.
type fileWarnings struct {
	MinRequests     int64    `yaml:"min_requests"`
	OverheadP95     duration `yaml:"overhead_p95"`
	QueueShare      share    `yaml:"queue_share"`
	TrendThroughput float64  `yaml:"trend_throughput"`
	TrendTTFT       float64  `yaml:"trend_ttft"`
}

type fileTenant struct {
	Name         string   `yaml:"name"`
	Keys         []string `yaml:"keys"`
	KeySHA256    []string `yaml:"key_sha256"`
	fileLimitSet `yaml:",inline"`
	Routes       map[string]fileLimitSet `yaml:"routes"`
	SLO          *fileSLO                `yaml:"slo"`
	// Priority is the most its requests may claim under overload control
	// (critical, standard, sheddable; default standard).
	Priority string `yaml:"priority"`
}

type fileLimitSet struct {
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	Burst             int     `yaml:"burst"`
	TokensPerMinute   int64   `yaml:"tokens_per_minute"`
	MaxConcurrent     int     `yaml:"max_concurrent"`
	RequestsPerDay    int64   `yaml:"requests_per_day"`
	TokensPerDay      int64   `yaml:"tokens_per_day"`
	USDPerDay         float64 `yaml:"usd_per_day"`
	USDPerMonth       float64 `yaml:"usd_per_month"`
}

func (l fileLimitSet) limits() ratelimit.Limits {
	return ratelimit.Limits{RequestsPerSecond: l.RequestsPerSecond, Burst: l.Burst, TokensPerMinute: l.TokensPerMinute, MaxConcurrent: l.MaxConcurrent,
		RequestsPerDay: l.RequestsPerDay, TokensPerDay: l.TokensPerDay, USDPerDay: l.USDPerDay, USDPerMonth: l.USDPerMonth}
}

type fileAdmission struct {
	Mode                string     `yaml:"mode"`
	MaxQueue            *int       `yaml:"max_queue"`
	MaxWait             duration   `yaml:"max_wait"`
	UnknownKey          string     `yaml:"unknown_key"`
	TrustedTenantHeader string     `yaml:"trusted_tenant_header"`
	DefaultMaxOutput    int        `yaml:"default_max_output"`
	IdleTTL             duration   `yaml:"idle_ttl"`
	Store               *fileStore `yaml:"store"`
}

// fileStore is the shared admission store.
type fileStore struct {
	Redis struct {
		Addr         string   `yaml:"addr"`
		Username     string   `yaml:"username"`
		PasswordFile string   `yaml:"password_file"`
		DB           int      `yaml:"db"`
		TLS          bool     `yaml:"tls"`
		Timeout      duration `yaml:"timeout"`
		KeyPrefix    string   `yaml:"key_prefix"`
	} `yaml:"redis"`
	Fail     string   `yaml:"fail"`
	LeaseTTL duration `yaml:"lease_ttl"`
	MinShare share    `yaml:"min_share"`
}

type fileModels struct {
	Allow    []string `yaml:"allow"`
	Enforce  bool     `yaml:"enforce"`
	PerRoute *int     `yaml:"per_route"`
}

type fileTimeouts struct {
	Connect      duration `yaml:"connect"`
	Write        duration `yaml:"write"`
	FirstByte    duration `yaml:"first_byte"`
	Idle         duration `yaml:"idle"`
	IdleConn     duration `yaml:"idle_conn"`
	MaxIdleConns *int     `yaml:"max_idle_conns"`
	MaxConns     *int     `yaml:"max_conns"`
}

type fileLimits struct {
	MaxRequestBody       int64    `yaml:"max_request_body"`
	MaxBufferedBodies    int64    `yaml:"max_buffered_bodies"`
	MaxEventBytes        int      `yaml:"max_event_bytes"`
	ClientWriteTimeout   duration `yaml:"client_write_timeout"`
	RequestReadTimeout   duration `yaml:"request_read_timeout"`
	ClientIdleTimeout    duration `yaml:"client_idle_timeout"`
	MaxClientConns       int      `yaml:"max_client_conns"`
	MaxClientConnsPerIP  int      `yaml:"max_client_conns_per_ip"`
	DecodedBytesPerReply int64    `yaml:"max_decoded_bytes"`
}

// loadFile reads and strictly decodes a config file: unknown keys are errors
// naming the key and its line.
func loadFile(path string) (*fileConfig, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return parseConfig(b, path)
}

func parseConfig(b []byte, name string) (*fileConfig, error) {
	var fc fileConfig
	pos := &positions{lines: map[string]int{}}
	var root yaml.Node
	if err := yaml.Unmarshal(b, &root); err == nil {
		pos = indexFile(&root)
	}
	fc.lines = pos.lines
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&fc); err != nil && !errors.Is(err, io.EOF) {
		return nil, errors.New(pos.locate(name, err))
	}
	return &fc, nil
}

// cleanYAMLError turns each of yaml's "field x not found in type
// main.fileRoute" into "unknown field x", one error per line.
func cleanYAMLError(err error) string {
	s := strings.TrimPrefix(err.Error(), "yaml: ")
	s = strings.TrimPrefix(s, "unmarshal errors:\n")
	lines := strings.Split(s, "\n")
	for n, l := range lines {
		if i := strings.Index(l, " not found in type "); i >= 0 {
			if j := strings.Index(l, "field "); j >= 0 && j < i {
				lines[n] = l[:j] + "unknown field " + l[j+len("field "):i]
			}
		}
	}
	return strings.Join(lines, "\n")
}

// flags are the command-line settings that override the file.
type flags struct {
	listen, admin, upstream, accessLog, config string
	slo                                        string // -slo ttft=500ms,tpot=50ms
	watchConfig                                bool
	set                                        map[string]bool
}

// settings is everything main needs, after file and flags are merged.
type settings struct {
	listen, admin, accessLog string
	adminTokenFile           string
	adminHosts               []string
	drainTimeout, drainDelay time.Duration
	proxy                    proxy.Config
	opts                     proxy.Options
	otel                     *telemetry.Config     // nil: no export
	tls, adminTLS            *proxy.ServerTLSFiles // nil: plain listeners
	configFile               string                // -config
	watchConfig              bool                  // -watch-config: reload when the file changes
}

func ptrOr(p *string) string {
	if p == nil {
		return ""
	}
	return *p
}

// checkAddr checks a listen address: host:port with a port from 0 to
// 65535 (0: any free port).
func checkAddr(addr string) error {
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("%q: port must be a number from 0 to 65535", addr)
	}
	return nil
}

func applyTimeouts(t proxy.Timeouts, ft *fileTimeouts) proxy.Timeouts {
	set := func(dst *time.Duration, d duration) {
		if d.set {
			*dst = d.d
		}
	}
	set(&t.Connect, ft.Connect)
	set(&t.Write, ft.Write)
	set(&t.FirstByte, ft.FirstByte)
	set(&t.Idle, ft.Idle)
	set(&t.IdleConn, ft.IdleConn)
	if ft.MaxIdleConns != nil {
		t.MaxIdleConns = *ft.MaxIdleConns
	}
	if ft.MaxConns != nil {
		t.MaxConns = *ft.MaxConns
	}
	return t
}
