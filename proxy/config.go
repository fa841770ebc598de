package proxy

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
)

// Timeouts bound the upstream side of an exchange. None of them limits the
// total length of a response: a long, healthy stream is never cut.
type Timeouts struct {
	// Connect bounds dialing (and the TLS handshake) to the upstream.
	Connect time.Duration
	// Write bounds writing the request to the upstream.
	Write time.Duration
	// FirstByte bounds the wait from the request written to the first byte
	// of the response: the backend's queueing and prefill.
	FirstByte time.Duration
	// Idle bounds the gap between two reads of the response body.
	Idle time.Duration
	// IdleConn is how long an unused keep-alive connection stays pooled;
	// it is closed then, with or without traffic. The backend's own
	// Keep-Alive header (timeout, max) shortens it. Every pooled connection
	// is checked before reuse (one non-consuming peek): one the backend
	// closed is replaced, one with unread bytes is closed. A request the
	// backend provably never received (reset before it acknowledged a byte
	// of it) is sent again once on a new connection; one it received never
	// is.
	IdleConn time.Duration
	// MaxIdleConns caps the pooled idle connections per upstream.
	MaxIdleConns int
	// MaxConns caps the open connections per upstream (0: no cap). Every
	// live stream holds one.
	MaxConns int
}

// DefaultTimeouts are the timeouts used where the config says nothing.
var DefaultTimeouts = Timeouts{
	Connect:   5 * time.Second,
	Write:     30 * time.Second,
	FirstByte: 10 * time.Minute,
	Idle:      2 * time.Minute,
	// As Go's http.Transport. A short lifetime would make the first burst
	// after every lull dial anew: a dial costs tokentap several times a
	// request's CPU, and the burst's first tokens wait behind it.
	IdleConn:     90 * time.Second,
	MaxIdleConns: 1024,
	MaxConns:     0,
}

// Route sends requests whose path starts with Prefix to Upstream.
type Route struct {
	// Name labels the route's metrics and records.
	Name string
	// Prefix is the path prefix the route matches; the longest match wins.
	Prefix string
	// Upstream is the backend's base URL (http or https); a path in it is
	// put in front of the request path.
	Upstream string
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
}

// Config is one generation of the proxy's configuration.
type Config struct {
	Routes []Route
	// Models is the model allowlist: metric label values for models. Every
	// other model is labelled "other".
	Models []string
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
	// DefaultMaxOutput is the output a request reserves of its token budget
	// when it declares no limit (default 1024).
	DefaultMaxOutput int
}

// Validate checks c and names the field at fault.
func (c *Config) Validate() error {
	if len(c.Routes) == 0 {
		return errors.New("routes: at least one route is required (or give -upstream)")
	}
	names := map[string]bool{}
	prefixes := map[string]bool{}
	for i, r := range c.Routes {
		field := func(f string) string { return fmt.Sprintf("routes[%d].%s", i, f) }
		switch {
		case r.Name == "":
			return fmt.Errorf("%s: must not be empty", field("name"))
		case r.Name == metrics.UnmatchedRoute:
			return fmt.Errorf("%s: %q is reserved for requests that match no route", field("name"), r.Name)
		case names[r.Name]:
			return fmt.Errorf("%s: duplicate route name %q", field("name"), r.Name)
		case r.Prefix == "" || r.Prefix[0] != '/':
			return fmt.Errorf("%s: must start with /, got %q", field("prefix"), r.Prefix)
		case prefixes[r.Prefix]:
			return fmt.Errorf("%s: duplicate prefix %q", field("prefix"), r.Prefix)
		}
		// Requests are matched in normal form, so a prefix in any other
		// form would never match.
		if norm, err := normalizePath(nil, []byte(r.Prefix)); err != nil || string(norm) != r.Prefix {
			return fmt.Errorf("%s: %q is not a normalised path (no dot segments, repeated slashes or escapes of unreserved characters)", field("prefix"), r.Prefix)
		}
		names[r.Name], prefixes[r.Prefix] = true, true
		if r.Dialect != "" && dialect.ByName(r.Dialect) == nil {
			return fmt.Errorf("%s: unknown dialect %q (known: %s)", field("dialect"), r.Dialect, dialectNames())
		}
		if _, err := newUpstream(r.Upstream, r.Timeouts, nil); err != nil {
			return fmt.Errorf("%s: %q: %w", field("upstream"), r.Upstream, err)
		}
	}
	seen := map[string]bool{}
	for i, m := range c.Models {
		if m == "" || m == metrics.OtherModel || seen[m] {
			return fmt.Errorf("models.allow[%d]: %q must be a distinct model name other than %q", i, m, metrics.OtherModel)
		}
		seen[m] = true
	}
	if c.MaxDecodedBytes < 0 {
		return errors.New("limits.max_decoded_bytes: must not be negative")
	}
	if c.MaxEventBytes < 0 {
		return errors.New("max_event_bytes: must not be negative")
	}
	if c.DefaultMaxOutput < 0 {
		return errors.New("admission.default_max_output: must not be negative")
	}
	if c.Admission != nil {
		if err := c.Admission.Validate(); err != nil {
			return err
		}
		for i, t := range c.Admission.Tenants {
			for route := range t.Routes {
				if !names[route] {
					return fmt.Errorf("tenants[%d].routes.%s: no route has this name", i, route)
				}
			}
		}
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
