package metrics

import (
	"sync"
	"sync/atomic"

	vm "github.com/VictoriaMetrics/metrics"
)

// Models by name, bounded. Beside the allowlist (NewSet's models), each
// route labels the models its own globs name literally (RouteRow.Models)
// and the first SetOptions.PerRoute others it sees (by their names as
// requests give them): a route in front of a handful of models shows each
// on its own line without configuring them twice. Past the bound a model
// is "other", and counted (tokentap_models_folded_total{route}); a name
// that is not a plain model name (longer than maxLearnedModel, or with a
// character outside [A-Za-z0-9._:/@+-]) is never learned. A reload keeps
// what each route learned (SetOptions.Carry), so the series of a route
// are bounded by its literals and PerRoute over the process's life.

// DefaultPerRoute is SetOptions.PerRoute's default.
const DefaultPerRoute = 8

// maxLearnedModel bounds a learned model name's length.
const maxLearnedModel = 64

// routeModels is what one route learned: its model names by index (each
// past the allowlist's "other"), and the rows of its upstreams.
type routeModels struct {
	route  string
	rows   []int
	limit  int // its literals and PerRoute
	mu     sync.Mutex
	names  atomic.Pointer[map[string]int] // copied on write
	order  []string                       // in the order learned
	folded *vm.Counter                    // made at the first model folded
}

// learnable reports a model name that may become a label value.
func learnable(model []byte) bool {
	if len(model) == 0 || len(model) > maxLearnedModel {
		return false
	}
	for _, c := range model {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == ':' || c == '/' || c == '@' || c == '+' || c == '-') {
			return false
		}
	}
	return true
}

// learn gives model an index on route rm, making its series on each of
// the route's rows, while the route has room; else the index of "other",
// the model counted as folded.
func (s *Set) learn(rm *routeModels, model []byte) int {
	rm.mu.Lock()
	defer rm.mu.Unlock()
	if i, ok := (*rm.names.Load())[string(model)]; ok {
		return i
	}
	if !learnable(model) || len(rm.order) >= rm.limit {
		if !s.noSeries {
			if rm.folded == nil { // made at its first use: an idle route has none
				rm.folded = durable.GetOrCreateCounter(`tokentap_models_folded_total{route="` + rm.route + `"}`)
			}
			rm.folded.Inc()
		}
		return s.OtherIndex()
	}
	name := string(model)
	slot := len(rm.order)
	for _, row := range rm.rows {
		s.learned[row][slot].Store(newSeries(rm.route, s.upstreams[row], name, s.buckets, s.slo, s.noSeries))
	}
	names := make(map[string]int, len(rm.order)+1)
	for k, v := range *rm.names.Load() {
		names[k] = v
	}
	i := s.OtherIndex() + 1 + slot
	names[name] = i
	rm.order = append(rm.order, name)
	rm.names.Store(&names)
	return i
}

// LearnedModels returns the models route learned, in the order learned
// (its literals first).
func (s *Set) LearnedModels(route string) []string {
	for _, rm := range s.byRoute {
		if rm.route == route {
			rm.mu.Lock()
			defer rm.mu.Unlock()
			return append([]string(nil), rm.order...)
		}
	}
	return nil
}
