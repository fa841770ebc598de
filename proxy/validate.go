package proxy

// Checking a configuration: each rule names the field it refuses, as the
// path of its key in the config file; each concern checks its own section
// (upstream.Timeouts, upstream.TLS, admission.Overload, routing's paths
// and models, measure's prices and classes), and this file the routes'
// shape and what ties the sections together.

import (
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/routing"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/sse/dialect"
)

// hasSLO reports whether any route can be judged.
func (c *Config) hasSLO() bool {
	if !c.SLO.IsZero() || len(c.TenantSLOs) > 0 {
		return true
	}
	for _, r := range c.Routes {
		if !r.SLO.IsZero() {
			return true
		}
	}
	return false
}

// validSLO checks one SLO under path.
func validSLO(path string, s metrics.SLO) error {
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"ttft", s.TTFT}, {"ttfa", s.TTFA}, {"tpot", s.TPOT}, {"e2e", s.E2E}} {
		if d.v < 0 {
			return conf.Errf(path+"."+d.name, "must be positive")
		}
	}
	if s.Measure != "" && s.Measure != metrics.MeasureClient && s.Measure != metrics.MeasureProxy {
		return conf.Errf(path+".measure", "must be client or proxy, got %q", s.Measure)
	}
	if s.Target < 0 || s.Target > 1 {
		return conf.Errf(path+".target", "must be a share between 0 and 1 (or a percentage such as 99%%)")
	}
	if s.QoE < 0 || s.QoE > 1 {
		return conf.Errf(path+".qoe", "must be a score between 0 and 1 (0.9, or 90%%)")
	}
	return nil
}

// Validate checks every rule of c; its errors are *FieldError (or
// *ratelimit.FieldError for admission).
func (c *Config) Validate() error {
	names, err := c.validRoutes()
	if err != nil {
		return err
	}
	if err := c.validModelsAndSLOs(); err != nil {
		return err
	}
	if err := measure.ValidPrices(c.Prices); err != nil {
		return err
	}
	if c.MaxDecodedBytes < 0 {
		return conf.Errf("limits.max_decoded_bytes", "must not be negative")
	}
	if c.MaxEventBytes < 0 {
		return conf.Errf("limits.max_event_bytes", "must not be negative")
	}
	if c.DefaultMaxOutput < 0 {
		return conf.Errf("admission.default_max_output", "must not be negative")
	}
	if err := c.Classes.Validate(); err != nil {
		return err
	}
	if c.Admission != nil {
		if err := c.Admission.Validate(); err != nil {
			return err
		}
		for i, t := range c.Admission.Tenants {
			for route := range t.Routes {
				if !names[route] {
					return conf.Errf(fmt.Sprintf("tenants[%d].routes.%s", i, route), "no route has this name")
				}
			}
		}
	}
	return nil
}

// validRoutes checks each route and returns their names.
func (c *Config) validRoutes() (map[string]bool, error) {
	if len(c.Routes) == 0 {
		return nil, conf.Errf("routes", "at least one route is required (or give -upstream)")
	}
	names := map[string]bool{}
	for i, r := range c.Routes {
		field := func(f string) string { return fmt.Sprintf("routes[%d].%s", i, f) }
		switch {
		case r.Name == "":
			return nil, conf.Errf(field("name"), "must not be empty")
		case r.Name == metrics.UnmatchedRoute:
			return nil, conf.Errf(field("name"), "%q is reserved for requests that match no route", r.Name)
		case names[r.Name]:
			return nil, conf.Errf(field("name"), "duplicate route name %q", r.Name)
		case r.Prefix == "" || r.Prefix[0] != '/':
			return nil, conf.Errf(field("prefix"), "must start with /, got %q", r.Prefix)
		}
		if err := validModels(c.Routes, i, field); err != nil {
			return nil, err
		}
		// Requests are matched in normal form, so a prefix in any other
		// form would never match.
		if norm, err := routing.NormalizePath(nil, []byte(r.Prefix)); err != nil || string(norm) != r.Prefix {
			return nil, conf.Errf(field("prefix"), "%q is not a normalised path (no dot segments, repeated slashes or escapes of unreserved characters)", r.Prefix)
		}
		names[r.Name] = true
		if r.Dialect != "" && dialect.ByName(r.Dialect) == nil {
			return nil, conf.Errf(field("dialect"), "unknown dialect %q (known: %s)", r.Dialect, dialectNames())
		}
		if err := r.Timeouts.Validate(field("timeouts")); err != nil {
			return nil, err
		}
		if err := validSLO(field("slo"), r.SLO); err != nil {
			return nil, err
		}
		if r.QoE.TTFT < 0 || r.QoE.Read < 0 {
			return nil, conf.Errf(field("qoe"), "ttft and pace must be positive durations")
		}
		if err := r.validUpstreams(field); err != nil {
			return nil, err
		}
		slos := []metrics.SLO{c.SLO.Over(r.SLO)}
		for _, t := range c.TenantSLOs {
			slos = append(slos, t)
		}
		if err := r.Overload.Validate(field, slos...); err != nil {
			return nil, err
		}
	}
	return names, nil
}

// validModelsAndSLOs checks the models allowed, the SLOs and the metrics'
// buckets.
func (c *Config) validModelsAndSLOs() error {
	if c.EnforceModels && len(c.Models) == 0 {
		return conf.Errf("models.enforce", "enforce needs a non-empty models.allow list")
	}
	seen := map[string]bool{}
	for i, m := range c.Models {
		if m == "" || m == metrics.OtherModel || seen[m] {
			return conf.Errf(fmt.Sprintf("models.allow[%d]", i), "%q must be a distinct model name other than %q", m, metrics.OtherModel)
		}
		seen[m] = true
	}
	if err := validSLO("slo", c.SLO); err != nil {
		return err
	}
	for m, b := range c.Buckets {
		if err := metrics.CheckBuckets(m, b); err != nil {
			return conf.Errf("metrics.buckets."+m, "%v", err)
		}
	}
	for name, s := range c.TenantSLOs {
		known := false
		if c.Admission != nil {
			for _, t := range c.Admission.Tenants {
				known = known || t.Name == name
			}
		}
		if !known {
			return conf.Errf("tenants."+name+".slo", "no tenant has this name")
		}
		if err := validSLO("tenants."+name+".slo", s); err != nil {
			return err
		}
	}
	return nil
}

// validUpstreams checks the route's one upstream, or its several with
// their balance and stickiness.
func (r *Route) validUpstreams(field func(string) string) error {
	if r.TLS != nil {
		if f, err := r.TLS.Check(); err != nil {
			return conf.Errf(field("tls."+f), "%v", err)
		}
		https := strings.HasPrefix(r.Upstream, "https://")
		for _, u := range r.Upstreams {
			https = https || strings.HasPrefix(u.URL, "https://")
		}
		if !https {
			return conf.Errf(field("tls"), "the route has no https upstream")
		}
	}
	if err := upstream.ValidHeaders(r.Headers, field("headers")); err != nil {
		return err
	}
	if len(r.Upstreams) == 0 {
		if _, err := upstream.New(r.Upstream, r.Timeouts, nil, r.TLS); err != nil {
			return conf.Errf(field("upstream"), "%q: %v", upstream.RedactURL(r.Upstream), err)
		}
		if r.Balance != "" || r.Sticky != "" || r.Guard != nil || r.Failover != nil || r.Shadow != nil {
			return conf.Errf(field("balance"), "balance, sticky, guard, failover and shadow need upstreams")
		}
		return nil
	}
	if r.Upstream != "" {
		return conf.Errf(field("upstreams"), "give upstream or upstreams, not both")
	}
	names := map[string]bool{}
	total := 0
	for i, u := range r.Upstreams {
		f := func(k string) string { return field(fmt.Sprintf("upstreams[%d].%s", i, k)) }
		switch {
		case u.Name == "" || names[u.Name]:
			return conf.Errf(f("name"), "must be a distinct, non-empty name")
		case u.Weight < 0:
			return conf.Errf(f("weight"), "must not be negative")
		}
		up, err := upstream.New(u.URL, r.Timeouts, nil, r.TLS)
		if err != nil {
			return conf.Errf(f("url"), "%q: %v", upstream.RedactURL(u.URL), err)
		}
		switch u.Protocol {
		case "", upstream.ProtocolHTTP1:
		case upstream.ProtocolH2C:
			if err := up.UseH2C(); err != nil {
				return conf.Errf(f("protocol"), "%v", err)
			}
		default:
			return conf.Errf(f("protocol"), "%q is not http/1.1 or h2c", u.Protocol)
		}
		if err := upstream.ValidHeaders(u.Headers, f("headers")); err != nil {
			return err
		}
		if m := u.MetricsURL; m != "" {
			if pu, err := url.Parse(m); err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
				return conf.Errf(f("metrics_url"), "%q is not an http or https URL", upstream.RedactURL(m))
			}
		}
		names[u.Name] = true
		total += u.Weight
	}
	if total == 0 {
		return conf.Errf(field("upstreams"), "at least one upstream needs a weight above 0")
	}
	if err := (routing.Options{Balance: r.Balance, Sticky: r.Sticky}).Validate(field); err != nil {
		return err
	}
	return r.validSplit(field, names)
}

// validSplit checks what a route with several upstreams does with them:
// shadow, failover and guard, against the upstreams' names.
func (r *Route) validSplit(field func(string) string, names map[string]bool) error {
	if sh := r.Shadow; sh != nil {
		switch {
		case !names[sh.Upstream]:
			return conf.Errf(field("shadow.upstream"), "%q is not one of the route's upstreams", sh.Upstream)
		case sh.Sample <= 0 || sh.Sample > 1:
			return conf.Errf(field("shadow.sample"), "must be a share above 0 and at most 1")
		case sh.MaxInflight < 0:
			return conf.Errf(field("shadow.max_inflight"), "must not be negative")
		case sh.Timeout < 0:
			return conf.Errf(field("shadow.timeout"), "must not be negative")
		}
	}
	if fo := r.Failover; fo != nil {
		for i, on := range fo.On {
			if on != FailoverConnect && on != FailoverStatus5xx && on != FailoverFirstToken {
				return conf.Errf(field(fmt.Sprintf("failover.on[%d]", i)), "must be %s, %s or %s, got %q", FailoverConnect, FailoverStatus5xx, FailoverFirstToken, on)
			}
		}
		switch {
		case len(fo.On) == 0:
			return conf.Errf(field("failover.on"), "name at least one failure")
		case fo.on(FailoverFirstToken) && fo.FirstTokenTimeout <= 0:
			return conf.Errf(field("failover.first_token_timeout"), "must be positive with first_token_timeout in on")
		}
	}
	if g := r.Guard; g != nil {
		return g.Validate(field, names, measure.ValidClass)
	}
	return nil
}

func dialectNames() string {
	names := make([]string, len(dialect.All))
	for i, d := range dialect.All {
		names[i] = d.Name()
	}
	return strings.Join(names, ", ")
}

// Warnings lists what a valid configuration says that may not do what was
// meant: each a field and why, printed by -check and logged when the
// configuration is applied.
func (c *Config) Warnings() []string {
	var ws []string
	warn := func(field, format string, args ...any) { ws = append(ws, field+": "+fmt.Sprintf(format, args...)) }
	tenants := c.Admission != nil && len(c.Admission.Tenants) > 0
	keyed := tenants && c.Admission.TrustedTenantHeader == ""
	anyModel := false
	for i, r := range c.Routes {
		field := func(f string) string { return fmt.Sprintf("routes[%d].%s", i, f) }
		anyModel = anyModel || len(r.Models) == 0
		if o := r.Overload; o != nil {
			switch {
			case o.PriorityHeader != "" && !tenants && !o.TrustPriorityHeader:
				warn(field("overload.priority_header"), "with no tenants to cap it, the header claims at most standard (any client could claim critical); set overload.trust_priority_header: true where every client may be believed")
			case o.TrustPriorityHeader && o.PriorityHeader == "":
				warn(field("overload.trust_priority_header"), "takes no effect without overload.priority_header")
			case o.TrustPriorityHeader && tenants:
				warn(field("overload.trust_priority_header"), "takes no effect with tenants: each tenant's priority caps its requests")
			}
		}
		if r.ForwardClientKey && !keyed {
			warn(field("forward_client_key"), "takes no effect: the client's key headers are dropped only where tenants are known by key")
		}
	}
	// A price whose glob meets no route's models (all routes name theirs)
	// prices nothing a route serves by name (a response may still name
	// another model: hence a warning).
	for i, p := range c.Prices {
		used := anyModel
		for _, r := range c.Routes {
			for _, g := range r.Models {
				used = used || conf.Glob(p.Model, g) || conf.Glob(g, p.Model)
			}
		}
		if !used {
			warn(fmt.Sprintf("prices[%d].model", i), "%q meets no model a route names: no request is priced by it unless its response names such a model", p.Model)
		}
	}
	return ws
}

// validModels checks route i's models and that routes sharing a prefix
// are told apart by them: at most one of them takes every model.
func validModels(routes []Route, i int, field func(string) string) error {
	r := routes[i]
	if r.Models != nil && len(r.Models) == 0 {
		return conf.Errf(field("models"), "is empty: list the models the route serves (globs), or leave the key out for every model")
	}
	for j, g := range r.Models {
		if g == "" {
			return conf.Errf(field(fmt.Sprintf("models[%d]", j)), "must not be empty")
		}
	}
	for j := 0; j < i; j++ {
		o := routes[j]
		if o.Prefix != r.Prefix {
			continue
		}
		if len(o.Models) == 0 && len(r.Models) == 0 {
			return conf.Errf(field("prefix"), "duplicate prefix %q: routes that share a prefix must name the models they serve (models:), all but one at most", r.Prefix)
		}
	}
	return nil
}
