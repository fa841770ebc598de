// Package ratelimit is tokentap's admission control: it maps API keys to
// tenants and decides, per tenant (and optionally per tenant and route),
// whether a request may go upstream now, must wait in the tenant's queue,
// or is refused. It knows nothing of HTTP: it takes a tenant, a route, a
// token estimate and a context, and returns a Ticket or a Refusal with the
// wait after which a retry can succeed.
//
// Three limits, each optional: requests per second with a burst
// (golang.org/x/time/rate); tokens per minute, where a request reserves its
// estimate before it is forwarded and the reservation is reconciled with the
// real usage when it ends (Ticket.Release); and concurrent requests, held
// until the response's last byte.
//
//	a := ratelimit.New(cfg, time.Now, nil)
//	t, refusal := a.Admit(ctx, "alpha", "chat", estimate)
//	if refusal != nil { /* 429 with refusal.RetryAfter */ }
//	defer t.Release(actualTokens)
package ratelimit

import (
	"fmt"
	"math"
	"time"
)

// Limits are one set of limits; a zero field means "no limit".
type Limits struct {
	// RequestsPerSecond is the sustained request rate; Burst the requests
	// allowed at once (default: RequestsPerSecond rounded up, at least 1).
	RequestsPerSecond float64
	Burst             int
	// TokensPerMinute is the token budget: input and output tokens together,
	// refilled continuously.
	TokensPerMinute int64
	// MaxConcurrent bounds requests in flight; a stream counts until its
	// last byte.
	MaxConcurrent int
	// RequestsPerDay and TokensPerDay are budgets per UTC day (tokens
	// reserved before forwarding and reconciled after, as per minute); a
	// refusal says when the day ends.
	RequestsPerDay, TokensPerDay int64
	// USDPerDay and USDPerMonth are dollar budgets per UTC day and UTC
	// calendar month: a request's cost at its model's price is reserved
	// from its input and output estimate before forwarding and reconciled
	// with what it cost (AdmitUSD, ReleaseUSD); a refusal says when the
	// day or month ends.
	USDPerDay, USDPerMonth float64
}

func (l Limits) any() bool {
	return l.RequestsPerSecond > 0 || l.TokensPerMinute > 0 || l.MaxConcurrent > 0 || l.RequestsPerDay > 0 || l.TokensPerDay > 0 ||
		l.USDPerDay > 0 || l.USDPerMonth > 0
}

// Tenant is one configured tenant.
type Tenant struct {
	Name string
	// Keys are API keys in plain text; KeySHA256 are hex SHA-256 digests of
	// keys, so a config can name keys without holding them.
	Keys      []string
	KeySHA256 []string
	Limits    Limits
	// Routes holds limits that apply to the tenant's requests on one route,
	// in addition to Limits.
	Routes map[string]Limits
}

// Mode says what happens to a request over a limit.
type Mode string

const (
	// ModeReject refuses at once (429 with Retry-After).
	ModeReject Mode = "reject"
	// ModeQueue waits in the tenant's queue, up to MaxWait, then refuses.
	ModeQueue Mode = "queue"
)

// Config is the admission part of tokentap's configuration.
type Config struct {
	Tenants []Tenant
	Mode    Mode
	// MaxQueue bounds each tenant's queue; MaxWait the time a request may
	// spend in it.
	MaxQueue int
	MaxWait  time.Duration
	// UnknownKey is the tenant that absorbs requests with an unknown or no
	// key; empty means refuse them (401).
	UnknownKey string
	// TrustedTenantHeader, when set, names the request header that carries
	// the tenant (set by an authenticating gateway in front); keys are then
	// not looked at.
	TrustedTenantHeader string
	// IdleTTL is how long the limiter state of an idle tenant is kept
	// (default 10 minutes). State is only dropped once it has refilled, so
	// dropping it never gives a tenant more than waiting would have.
	IdleTTL time.Duration
	// Store, when set, keeps every tenant's counts in a store shared by
	// the replicas that name it (Redis): the limits then hold across them.
	// nil: in this process.
	Store *StoreConfig
}

// FieldError is a configuration error: the field at fault, as the path of
// its key in tokentap's config file (tenants[2].burst), and what is wrong.
type FieldError struct{ Path, Msg string }

func (e *FieldError) Error() string { return e.Path + ": " + e.Msg }

// Field returns the path of the field at fault.
func (e *FieldError) Field() string { return e.Path }

func fieldErr(path, format string, args ...any) error {
	return &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)}
}

// The defaults of the fields left zero (WithDefaults).
const (
	DefaultMaxQueue = 100
	DefaultMaxWait  = 2 * time.Second
	DefaultIdleTTL  = 10 * time.Minute
)

// WithDefaults returns c with its zero fields set to their defaults: mode
// reject, queues of DefaultMaxQueue requests waiting at most
// DefaultMaxWait, idle state kept DefaultIdleTTL.
func (c Config) WithDefaults() Config {
	if c.Mode == "" {
		c.Mode = ModeReject
	}
	if c.MaxQueue == 0 {
		c.MaxQueue = DefaultMaxQueue
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.IdleTTL == 0 {
		c.IdleTTL = DefaultIdleTTL
	}
	if c.Store != nil {
		s := c.Store.withDefaults()
		c.Store = &s
	}
	return c
}

// Validate checks c, its zero fields standing for their defaults; its
// errors are *FieldError.
func (c *Config) Validate() error {
	if len(c.Tenants) == 0 {
		return fieldErr("tenants", "at least one tenant is required for admission control")
	}
	switch c.Mode {
	case ModeReject, ModeQueue, "":
	default:
		return fieldErr("admission.mode", "%q must be reject or queue", c.Mode)
	}
	for _, f := range []struct {
		name     string
		negative bool
	}{{"max_queue", c.MaxQueue < 0}, {"max_wait", c.MaxWait < 0}, {"idle_ttl", c.IdleTTL < 0}} {
		if f.negative {
			return fieldErr("admission."+f.name, "must not be negative")
		}
	}
	if c.Store != nil {
		if err := c.Store.validate(); err != nil {
			return err
		}
	}
	names := map[string]bool{}
	keys := map[string]string{}
	for i, t := range c.Tenants {
		f := func(field string) string { return fmt.Sprintf("tenants[%d].%s", i, field) }
		if t.Name == "" {
			return fieldErr(f("name"), "must not be empty")
		}
		if names[t.Name] {
			return fieldErr(f("name"), "duplicate tenant %q", t.Name)
		}
		names[t.Name] = true
		if err := t.Limits.validate(f); err != nil {
			return err
		}
		for route, l := range t.Routes {
			if err := l.validate(func(field string) string { return f("routes." + route + "." + field) }); err != nil {
				return err
			}
		}
		for j, k := range t.Keys {
			if k == "" {
				return fieldErr(f(fmt.Sprintf("keys[%d]", j)), "must not be empty")
			}
			if other, dup := keys[k]; dup {
				return fieldErr(f(fmt.Sprintf("keys[%d]", j)), "key also given to tenant %q", other)
			}
			keys[k] = t.Name
		}
		for j, h := range t.KeySHA256 {
			if !isHexDigest(h) {
				return fieldErr(f(fmt.Sprintf("key_sha256[%d]", j)), "must be 64 hex digits")
			}
		}
	}
	if c.UnknownKey != "" && c.UnknownKey != "reject" && !names[c.UnknownKey] {
		return fieldErr("admission.unknown_key", "%q is neither reject nor a tenant", c.UnknownKey)
	}
	return nil
}

func (l Limits) validate(f func(string) string) error {
	switch {
	case l.RequestsPerSecond < 0:
		return fieldErr(f("requests_per_second"), "must not be negative")
	case l.Burst < 0:
		return fieldErr(f("burst"), "must not be negative")
	case l.Burst > 0 && l.RequestsPerSecond == 0:
		return fieldErr(f("burst"), "needs requests_per_second")
	case l.TokensPerMinute < 0:
		return fieldErr(f("tokens_per_minute"), "must not be negative")
	case l.MaxConcurrent < 0:
		return fieldErr(f("max_concurrent"), "must not be negative")
	case l.RequestsPerDay < 0:
		return fieldErr(f("requests_per_day"), "must not be negative")
	case l.TokensPerDay < 0:
		return fieldErr(f("tokens_per_day"), "must not be negative")
	case l.USDPerDay < 0 || math.IsNaN(l.USDPerDay) || math.IsInf(l.USDPerDay, 0):
		return fieldErr(f("usd_per_day"), "must be a number of dollars, 0 or more")
	case l.USDPerMonth < 0 || math.IsNaN(l.USDPerMonth) || math.IsInf(l.USDPerMonth, 0):
		return fieldErr(f("usd_per_month"), "must be a number of dollars, 0 or more")
	}
	return nil
}

func isHexDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}
