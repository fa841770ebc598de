package proxy

// A configuration generation as the request path sees it: the snapshot
// (routes by prefix, their metric handles and admitter, the upstream
// pools) and each route with its upstreams.

import (
	"sync/atomic"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/routing"
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
	// observers are told of each finished exchange, in order (observe.go).
	observers []observer
}

type route struct {
	Route
	slo     metrics.SLO // Config.SLO under the route's own
	index   int
	set     *routing.Set    // its upstreams and how a request's is chosen
	shadow  *shadowState    // nil: none
	dialect dialect.Dialect // nil: chosen per request from the path
	prices  []*Price        // the prices its requests may be at (routePrices)
	// stripKey: the client's key headers are not sent upstream
	// (proxy/upstream).
	stripKey bool
}

// scrapers calls f with each scraper of the generation's upstreams.
func (s *snapshot) scrapers(f func(*routing.Scraper)) {
	for _, r := range s.routes {
		r.set.Scrapers(f)
	}
}

// match returns the route for a normalised path, longest prefix first,
// prefixes matched on segment boundaries.
func (s *snapshot) match(path []byte) *route {
	for _, r := range s.routes {
		if routing.PrefixMatch(path, r.Prefix) {
			return r
		}
	}
	return nil
}

// late reports whether r's upstream is chosen once the request's body is
// read (routing.Set.Late).
func (r *route) late() bool { return r.set.Late() }

// predicts reports whether r's upstreams keep a prediction and show in
// /stats' overload table: for overload control, to balance by it, or
// beside prefix affinity (routing.Set.Predicts).
func (r *route) predicts() bool { return r.Overload != nil || r.set.Predicts() }

// strip is the prefix taken off the path sent upstream ("": none).
func (r *route) strip() string {
	if r.StripPrefix {
		return r.Prefix
	}
	return ""
}

// Routing by model. Several routes may share a path prefix when they name
// the models they serve (Route.Models, globs): one endpoint fronts several
// deployments. Routes are tried longest prefix first and, at one prefix,
// those that name models before the one that does not; the first whose
// globs match the request's model (the body's, or the path's where the
// dialect puts it there) serves it, a route without models any model. A
// route that names models is known only once the body is read, so its
// request's upstream is chosen, and its overload judged, then (as a
// least_ttft route's, which weighs the request's input).

// matchModel returns the route for a request to path naming model, once
// the body has said it (or nil: no route serves the model). A request that
// names no model goes to the first route without models, else to the
// first that matches its path.
func (s *snapshot) matchModel(path []byte, model string) *route {
	var first *route
	for _, r := range s.routes {
		if !routing.PrefixMatch(path, r.Prefix) {
			continue
		}
		if first == nil {
			first = r
		}
		if len(r.Models) == 0 || (model != "" && routing.Serves(r.Models, model)) {
			return r
		}
	}
	if model == "" {
		return first
	}
	return nil
}

// byModelOrder sorts routes for matching: longest prefix first and, at one
// prefix, the routes that name models before the one that does not.
func byModelOrder(a, b *route) bool {
	if len(a.Prefix) != len(b.Prefix) {
		return len(a.Prefix) > len(b.Prefix)
	}
	return len(a.Models) > 0 && len(b.Models) == 0
}

// shadowState is a route's shadow at run time.
type shadowState struct {
	Shadow
	member   *routing.Member
	inflight atomic.Int64
}
