package proxy

import (
	"fmt"
	"strings"

	"github.com/tokentap/tokentap/proxy/internal/conf"
)

// Routing by model. Several routes may share a path prefix when they name
// the models they serve (Route.Models, globs): one endpoint fronts several
// deployments. Routes are tried longest prefix first and, at one prefix,
// those that name models before the one that does not; the first whose
// globs match the request's model (the body's, or the path's where the
// dialect puts it there) serves it, a route without models any model. A
// route that names models is known only once the body is read, so its
// request's upstream is chosen, and its overload judged, then (as a
// least_ttft route's, which weighs the request's input).

// serves reports whether a route of models (globs) takes requests for
// model: one without models takes every model.
func serves(models []string, model string) bool {
	if len(models) == 0 {
		return true
	}
	for _, g := range models {
		if conf.Glob(g, model) {
			return true
		}
	}
	return false
}

// matchModel returns the route for a request to path naming model, once
// the body has said it (or nil: no route serves the model). A request that
// names no model goes to the first route without models, else to the
// first that matches its path.
func (s *snapshot) matchModel(path []byte, model string) *route {
	var first *route
	for _, r := range s.routes {
		if !prefixMatch(path, r.Prefix) {
			continue
		}
		if first == nil {
			first = r
		}
		if len(r.Models) == 0 || (model != "" && serves(r.Models, model)) {
			return r
		}
	}
	if model == "" {
		return first
	}
	return nil
}

// literalModels returns the globs of models that are plain names (no * or
// ?): each its own metric label on its route.
func literalModels(models []string) []string {
	var out []string
	for _, g := range models {
		if !strings.ContainsAny(g, "*?") {
			out = append(out, g)
		}
	}
	return out
}

// byModelOrder sorts routes for matching: longest prefix first and, at one
// prefix, the routes that name models before the one that does not.
func byModelOrder(a, b *route) bool {
	if len(a.Prefix) != len(b.Prefix) {
		return len(a.Prefix) > len(b.Prefix)
	}
	return len(a.Models) > 0 && len(b.Models) == 0
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
