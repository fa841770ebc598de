package main

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/metrics/telemetry"
	"github.com/tokentap/tokentap/proxy"
	"github.com/tokentap/tokentap/ratelimit"
)

// buildSettings merges the file (may be nil) and the flags, applies the
// defaults and validates the result, one section at a time. Errors name
// the field, and the file's line where there is one.
func buildSettings(fc *fileConfig, f flags) (*settings, error) {
	if fc == nil {
		fc = &fileConfig{}
	}
	b := &settingsBuilder{fc: fc, f: f, s: defaultSettings()}
	b.s.configFile, b.s.watchConfig = f.config, f.watchConfig
	for _, step := range []func() error{b.listeners, b.drain, b.routes, b.observing, b.telemetry, b.limits, b.admission, b.validate} {
		if err := step(); err != nil {
			return nil, err
		}
	}
	return b.s, nil
}

// defaultSettings are the command's own settings before the flags and the
// file: the addresses, the access log and the drain's bound. (An empty
// address turns a listener off, so these are starting values, not
// zero-value defaults; the proxy's and the admission's defaults are their
// types' own: proxy.Config, proxy.Options, ratelimit.Config.)
func defaultSettings() *settings {
	return &settings{listen: ":8080", admin: "127.0.0.1:9090", accessLog: "-", drainTimeout: 10 * time.Minute}
}

// settingsBuilder carries the sections' converters: the file and flags in,
// the settings out.
type settingsBuilder struct {
	fc       *fileConfig
	f        flags
	s        *settings
	upstream string         // the catch-all upstream, from -upstream or the file's key
	base     proxy.Timeouts // the file's timeouts over the defaults
}

// where names field with the file's line, when it has one.
func (b *settingsBuilder) where(field string) string {
	if line, ok := b.fc.lines[field]; ok && b.f.config != "" {
		return fmt.Sprintf("%s:%d: %s", b.f.config, line, field)
	}
	return field
}

// located gives an error that begins with a field's path
// ("routes[0].headers.Authorization: ...") the file line of that field, or
// of the nearest enclosing one the file records.
func (b *settingsBuilder) located(err error) error {
	msg := err.Error()
	field, _, ok := strings.Cut(msg, ": ")
	if !ok || b.f.config == "" {
		return err
	}
	for f := field; f != ""; {
		if line, ok := b.fc.lines[f]; ok {
			return fmt.Errorf("%s:%d: %w", b.f.config, line, err)
		}
		i := strings.LastIndexAny(f, ".[")
		if i < 0 {
			break
		}
		f = f[:i]
	}
	return err
}

// fileErr gives a *FieldError the file line of its field.
func (b *settingsBuilder) fileErr(err error) error {
	var fe interface{ Field() string }
	if errors.As(err, &fe) {
		if line, ok := b.fc.lines[fe.Field()]; ok && b.f.config != "" {
			return fmt.Errorf("%s:%d: %w", b.f.config, line, err)
		}
	}
	return err
}

// listeners: the proxy's and the admin's addresses, the access log and the
// admin's token and hosts. The file's value counts where the file sets one
// (an empty access_log or admin too: it turns them off), then the flag's.
func (b *settingsBuilder) listeners() error {
	fc, f, s := b.fc, b.f, b.s
	pick := func(dst *string, file string, inFile bool, flagName, flagVal string) {
		if inFile {
			*dst = file
		}
		if f.set[flagName] {
			*dst = flagVal
		}
	}
	pick(&s.listen, fc.Listen, fc.Listen != "", "listen", f.listen)
	pick(&s.admin, fc.Admin.Listen, fc.Admin.set, "admin", f.admin)
	pick(&s.accessLog, ptrOr(fc.AccessLog), fc.AccessLog != nil, "access-log", f.accessLog)
	pick(&b.upstream, fc.Upstream, fc.Upstream != "", "upstream", f.upstream)
	if err := checkAddr(s.listen); err != nil {
		return fmt.Errorf("%s: %w", b.where("listen"), err)
	}
	if s.admin != "" {
		if err := checkAddr(s.admin); err != nil {
			return fmt.Errorf("%s: %w", b.where("admin"), err)
		}
	}
	s.adminTokenFile, s.adminHosts = fc.Admin.TokenFile, fc.Admin.Hosts
	var err error
	if s.tls, err = b.serverTLS("tls", fc.TLS); err != nil {
		return err
	}
	if s.adminTLS, err = b.serverTLS("admin.tls", fc.Admin.TLS); err != nil {
		return err
	}
	if s.adminTokenFile != "" {
		if _, err := readToken(s.adminTokenFile); err != nil {
			return fmt.Errorf("%s: %w", b.where("admin.token_file"), err)
		}
	}
	return nil
}

// drain: how a shutdown drains, which relay streams take and what is
// measured.
func (b *settingsBuilder) drain() error {
	fc, s := b.fc, b.s
	for _, d := range []struct {
		name string
		v    duration
		dst  *time.Duration
	}{{"drain_timeout", fc.DrainTimeout, &s.drainTimeout}, {"drain_delay", fc.DrainDelay, &s.drainDelay}} {
		if !d.v.set {
			continue
		}
		if d.v.d <= 0 && d.name == "drain_timeout" {
			return fmt.Errorf("%s: must be positive", b.where(d.name))
		}
		*d.dst = d.v.d
	}
	m := fc.Measurement
	s.opts.NoStats, s.opts.NoSeries, s.opts.NoClientSide = off(m.Stats), off(m.Series), off(m.ClientSide)
	if m.MaxGroups < 0 {
		return fmt.Errorf("%s: must not be negative", b.where("measurement.max_groups"))
	}
	s.proxy.StatsMaxGroups = m.MaxGroups
	switch fc.Relay {
	case "", "loop":
	case "goroutine":
		s.opts.GoroutineRelay = true
	default:
		return fmt.Errorf("%s: %q is not loop or goroutine", b.where("relay"), fc.Relay)
	}
	return nil
}

// routes: the file's routes with their timeouts, and the catch-all
// upstream.
func (b *settingsBuilder) routes() error {
	fc, s := b.fc, b.s
	b.base = applyTimeouts(proxy.DefaultTimeouts, &fc.Timeouts)
	if err := b.base.Validate("timeouts"); err != nil {
		return b.fileErr(err)
	}
	s.proxy.Prices = prices(fc.Prices)
	for i, r := range fc.Routes {
		t := b.base
		if r.Timeouts != nil {
			t = applyTimeouts(b.base, r.Timeouts)
			if err := t.Validate(fmt.Sprintf("routes[%d].timeouts", i)); err != nil {
				return b.fileErr(err)
			}
		}
		ups, err := r.upstreams(i)
		if err != nil {
			return b.located(err)
		}
		hs, err := headers(r.Headers, fmt.Sprintf("routes[%d].headers", i))
		if err != nil {
			return b.located(err)
		}
		s.proxy.Routes = append(s.proxy.Routes, proxy.Route{
			Name: r.Name, Prefix: r.Prefix, Models: r.Models, Upstream: r.Upstream, StripPrefix: r.StripPrefix, Dialect: r.Dialect, InjectUsage: r.InjectUsage, WebSocket: r.WebSocket, Timeouts: t,
			SLO: r.SLO.slo(), QoE: r.QoE.pace(), Upstreams: ups, Balance: r.Balance, Sticky: r.Sticky,
			Shadow: r.Shadow.shadow(), Failover: r.Failover.failover(), Guard: r.Guard.guard(), TLS: r.TLS.upstreamTLS(),
			Overload: r.Overload.overload(), Headers: hs, ForwardClientKey: r.ForwardClientKey,
		})
	}
	return b.catchAll()
}

// catchAll adds the upstream given beside routes (or alone) as the route
// for prefix /: -upstream retargets a route with prefix /, the file's key
// stands back for one; without such a route either adds it.
func (b *settingsBuilder) catchAll() error {
	s, up := b.s, b.upstream
	if len(s.proxy.Routes) == 0 {
		if up == "" {
			return errors.New("upstream: no routes configured: give -upstream URL or routes in -config")
		}
		s.proxy.Routes = []proxy.Route{{Name: "default", Prefix: "/", Upstream: up, Timeouts: b.base}}
		return nil
	}
	if up == "" {
		return nil
	}
	found := false
	for i := range s.proxy.Routes {
		if s.proxy.Routes[i].Prefix == "/" {
			found = true
			if b.f.set["upstream"] {
				s.proxy.Routes[i].Upstream = up
			}
		}
	}
	if !found {
		s.proxy.Routes = append(s.proxy.Routes, proxy.Route{Name: "default", Prefix: "/", Upstream: up, Timeouts: b.base})
	}
	return nil
}

// observing: the SLO, the metrics' buckets, the live warnings and the
// models allowed.
func (b *settingsBuilder) observing() error {
	fc, s := b.fc, b.s
	s.proxy.SLO = fc.SLO.slo()
	if b.f.slo != "" {
		slo, err := parseSLO(b.f.slo)
		if err != nil {
			return err
		}
		s.proxy.SLO = s.proxy.SLO.Over(slo)
	}
	s.proxy.Buckets = fc.Metrics.Buckets
	w := fc.Warnings
	if w.MinRequests < 0 || w.TrendThroughput < 0 || w.TrendTTFT < 0 {
		return fmt.Errorf("%s: thresholds must not be negative", b.where("warnings"))
	}
	s.proxy.Warn = stats.WarnOptions{MinRequests: w.MinRequests, OverheadP95: w.OverheadP95.d, QueueShare: float64(w.QueueShare),
		TrendThroughput: w.TrendThroughput, TrendTTFT: w.TrendTTFT}
	s.proxy.Models = fc.Models.Allow
	s.proxy.EnforceModels = fc.Models.Enforce
	if n := fc.Models.PerRoute; n != nil {
		if *n < 0 {
			return fmt.Errorf("%s: must be 0 or more", b.where("models.per_route"))
		}
		s.proxy.ModelsPerRoute = *n
		if *n == 0 {
			s.proxy.ModelsPerRoute = -1 // none learned
		}
	}
	switch in := fc.Classes.InputTokens; len(in) {
	case 0:
	case 2:
		s.proxy.Classes.InputTokens = [2]int{in[0], in[1]}
	default:
		return fmt.Errorf("%s: two thresholds, [short below, long from]", b.where("classes.input_tokens"))
	}
	s.proxy.Classes.OutputTokens = fc.Classes.OutputTokens
	return nil
}

// limits: the bounds on bodies, events, timeouts and connections.
func (b *settingsBuilder) limits() error {
	l, s := &b.fc.Limits, b.s
	s.proxy.MaxEventBytes = l.MaxEventBytes
	if l.MaxRequestBody < 0 || l.MaxRequestBody > 1<<31-1 {
		return fmt.Errorf("%s: must be between 0 and 2147483647", b.where("limits.max_request_body"))
	}
	s.opts.MaxRequestBodySize = int(l.MaxRequestBody)
	if l.MaxBufferedBodies < 0 {
		return fmt.Errorf("%s: must not be negative", b.where("limits.max_buffered_bodies"))
	}
	s.opts.MaxBufferedBodies = l.MaxBufferedBodies
	for _, d := range []struct {
		name string
		v    duration
		dst  *time.Duration
	}{
		{"limits.client_write_timeout", l.ClientWriteTimeout, &s.opts.ClientWriteTimeout},
		{"limits.request_read_timeout", l.RequestReadTimeout, &s.opts.RequestReadTimeout},
		{"limits.client_idle_timeout", l.ClientIdleTimeout, &s.opts.IdleTimeout},
	} {
		if d.v.set && d.v.d <= 0 {
			return fmt.Errorf("%s: must be positive (leave it out for the default)", b.where(d.name))
		}
		*d.dst = d.v.d
	}
	if l.MaxClientConns < 0 {
		return fmt.Errorf("%s: must not be negative", b.where("limits.max_client_conns"))
	}
	if l.MaxClientConnsPerIP < 0 {
		return fmt.Errorf("%s: must not be negative", b.where("limits.max_client_conns_per_ip"))
	}
	s.opts.MaxConns, s.opts.MaxConnsPerIP = l.MaxClientConns, l.MaxClientConnsPerIP
	s.proxy.MaxDecodedBytes = l.DecodedBytesPerReply
	return nil
}

// admission: the tenants with their limits and SLOs, and how requests
// over a limit are treated.
func (b *settingsBuilder) admission() error {
	fc, s := b.fc, b.s
	if len(fc.Tenants) == 0 {
		if fc.lines["admission"] > 0 {
			return fmt.Errorf("%s: admission needs a tenants section", b.where("admission"))
		}
		return nil
	}
	// Left out, a field takes ratelimit's default (Config.WithDefaults);
	// written, a size or a wait must be positive.
	if q := fc.Admission.MaxQueue; q != nil && *q <= 0 {
		return fmt.Errorf("%s: must be positive (leave it out for the default, %d)", b.where("admission.max_queue"), ratelimit.DefaultMaxQueue)
	}
	if w := fc.Admission.MaxWait; w.set && w.d <= 0 {
		return fmt.Errorf("%s: must be positive (leave it out for the default, %s)", b.where("admission.max_wait"), ratelimit.DefaultMaxWait)
	}
	ad := &ratelimit.Config{
		Mode: ratelimit.Mode(fc.Admission.Mode), MaxWait: fc.Admission.MaxWait.d,
		UnknownKey: fc.Admission.UnknownKey, TrustedTenantHeader: fc.Admission.TrustedTenantHeader,
		IdleTTL: fc.Admission.IdleTTL.d,
	}
	if fc.Admission.MaxQueue != nil {
		ad.MaxQueue = *fc.Admission.MaxQueue
	}
	if st := fc.Admission.Store; st != nil {
		r := st.Redis
		sc := &ratelimit.StoreConfig{Fail: ratelimit.FailMode(st.Fail), LeaseTTL: st.LeaseTTL.d, MinShare: float64(st.MinShare),
			Redis: ratelimit.RedisConfig{Addr: r.Addr, Username: r.Username, DB: r.DB, TLS: r.TLS, Timeout: r.Timeout.d, KeyPrefix: r.KeyPrefix}}
		if r.PasswordFile != "" {
			pw, err := readSecretFile(r.PasswordFile)
			if err != nil {
				return fmt.Errorf("%s: %w", b.where("admission.store.redis.password_file"), err)
			}
			sc.Redis.Password = pw
		}
		ad.Store = sc
	}
	for i, t := range fc.Tenants {
		if t.Priority != "" {
			p, ok := proxy.ParsePriority(t.Priority)
			if !ok {
				return fmt.Errorf("%s: %q is not a priority (critical, standard, sheddable)", b.where(fmt.Sprintf("tenants[%d].priority", i)), t.Priority)
			}
			if s.proxy.TenantPriorities == nil {
				s.proxy.TenantPriorities = map[string]proxy.Priority{}
			}
			s.proxy.TenantPriorities[t.Name] = p
		}
		rt := ratelimit.Tenant{Name: t.Name, Keys: t.Keys, KeySHA256: t.KeySHA256, Limits: t.limits()}
		if len(t.Routes) > 0 {
			rt.Routes = map[string]ratelimit.Limits{}
			for route, l := range t.Routes {
				rt.Routes[route] = l.limits()
			}
		}
		ad.Tenants = append(ad.Tenants, rt)
		if t.SLO != nil {
			if s.proxy.TenantSLOs == nil {
				s.proxy.TenantSLOs = map[string]metrics.SLO{}
			}
			s.proxy.TenantSLOs[t.Name] = t.SLO.slo()
		}
	}
	s.proxy.Admission = ad
	s.proxy.DefaultMaxOutput = fc.Admission.DefaultMaxOutput
	return nil
}

// validate checks the whole proxy configuration. A fault in the route
// made from the catch-all upstream alone is named after the upstream key
// (its field, not its text, says so).
func (b *settingsBuilder) validate() error {
	err := b.s.proxy.Validate()
	var fe *proxy.FieldError
	if len(b.fc.Routes) == 0 && errors.As(err, &fe) && fe.Path == "routes[0].upstream" {
		return &proxy.FieldError{Path: "upstream", Msg: fe.Msg}
	}
	if err != nil {
		return b.fileErr(err)
	}
	return nil
}

// telemetry: the otel section, when present.
func (b *settingsBuilder) telemetry() error {
	o := b.fc.OTel
	if o == nil {
		return nil
	}
	c := &telemetry.Config{Endpoint: o.Endpoint, ServiceName: o.ServiceName, Traces: true, Metrics: true, Sample: 1, Queue: o.Queue}
	if o.Queue < 0 {
		return fmt.Errorf("%s: must not be negative", b.where("otel.queue"))
	}
	if o.Traces != nil {
		c.Traces = *o.Traces
	}
	if o.Metrics != nil {
		c.Metrics = *o.Metrics
	}
	if o.Sample != nil {
		c.Sample = *o.Sample
	}
	if c.Sample < 0 || c.Sample > 1 {
		return fmt.Errorf("%s: must be within 0 and 1", b.where("otel.sample"))
	}
	if !c.Traces && !c.Metrics {
		return fmt.Errorf("%s: traces and metrics are both off (leave out the section to turn the export off)", b.where("otel"))
	}
	if o.Endpoint != "" {
		u, err := url.Parse(o.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s: not an http:// or https:// URL", b.where("otel.endpoint"))
		}
	}
	switch o.Semconv {
	case "", telemetry.SemconvDefault, telemetry.SemconvLatest, telemetry.SemconvBoth:
		c.Semconv = o.Semconv
	default:
		return fmt.Errorf("%s: must be default, latest or both, got %q", b.where("otel.semconv"), o.Semconv)
	}
	if o.HeadersFile != "" {
		h, err := readHeadersFile(o.HeadersFile)
		if err != nil {
			return fmt.Errorf("%s: %w", b.where("otel.headers_file"), err)
		}
		c.Headers = h
	}
	b.s.otel = c
	return nil
}

// serverTLS reads and checks a listener's TLS section (nil: plain).
func (b *settingsBuilder) serverTLS(field string, t *fileTLS) (*proxy.ServerTLSFiles, error) {
	if t == nil {
		return nil, nil
	}
	f := &proxy.ServerTLSFiles{CertFile: t.CertFile, KeyFile: t.KeyFile, ClientCAFile: t.ClientCAFile}
	switch t.MinVersion {
	case "", "1.2":
		f.MinVersion = tls.VersionTLS12
	case "1.3":
		f.MinVersion = tls.VersionTLS13
	default:
		return nil, fmt.Errorf("%s: %q is not 1.2 or 1.3", b.where(field+".min_version"), t.MinVersion)
	}
	if _, err := proxy.LoadServerTLS(*f); err != nil {
		name := field + ".cert_file"
		if strings.HasPrefix(err.Error(), "client_ca_file") {
			name = field + ".client_ca_file"
		}
		return nil, fmt.Errorf("%s: %w", b.where(name), err)
	}
	return f, nil
}
