package proxy

// A configuration generation as the request path sees it: the snapshot
// (routes by prefix, their metric handles and admitter, the upstream
// pools) and each route with its upstreams.

import (
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/upstream"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
)

// snapshot is one immutable configuration generation with everything
// built from it: routes with their upstream pools, and metric handles.
type snapshot struct {
	cfg     Config
	routes  []*route // by descending prefix length, then those naming models (byModelOrder)
	metrics *metrics.Set
	admit   *ratelimit.Admitter       // nil: admission control off
	pools   map[string]*upstream.Pool // its upstreams' connections, by poolKey
}

type route struct {
	Route
	slo     metrics.SLO // Config.SLO under the route's own
	index   int
	members []*member       // its upstreams: one, or Route.Upstreams
	weights int             // the members' weights summed
	guard   *guardState     // nil: none
	shadow  *shadowState    // nil: none
	dialect dialect.Dialect // nil: chosen per request from the path
	aff     *affinity       // sticky: prefix: the hash ring and the loads (affinity.go)
	prices  []*Price        // the prices its requests may be at (routePrices)
	// stripKey: the client's key headers are not sent upstream
	// (proxy/upstream).
	stripKey bool
}

// scrapers calls f with each scraper of the generation's upstreams.
func (s *snapshot) scrapers(f func(*scraper)) {
	for _, r := range s.routes {
		for _, m := range r.members {
			if m.scrape != nil {
				f(m.scrape)
			}
		}
	}
}

// match returns the route for a normalised path, longest prefix first,
// prefixes matched on segment boundaries.
func (s *snapshot) match(path []byte) *route {
	for _, r := range s.routes {
		if prefixMatch(path, r.Prefix) {
			return r
		}
	}
	return nil
}

// member returns r's upstream named name (validated to exist).
func (r *route) member(name string) *member {
	for _, m := range r.members {
		if m.name == name {
			return m
		}
	}
	return nil
}

// strip is the prefix taken off the path sent upstream ("": none).
func (r *route) strip() string {
	if r.StripPrefix {
		return r.Prefix
	}
	return ""
}

// closeIdle closes the idle connections of every upstream of r.
func (r *route) closeIdle() {
	for _, m := range r.members {
		m.up.CloseIdle()
	}
}
