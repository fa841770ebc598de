package metrics

import (
	"sync"

	vm "github.com/VictoriaMetrics/metrics"
)

// What requests cost, and what the backends' prompt caches served and
// stored: counted for every series, with measurement.series off too (these
// are accounts, not latency figures).
//
//	tokentap_cost_usd_total{route,model,tenant}
//	tokentap_cached_tokens_total{route,model}
//	tokentap_cache_write_tokens_total{route,model}
//
// The label values are bounded as the series' are: routes and tenants from
// the configuration, models from its allowlist (others are "other").

type costKey struct{ route, model, tenant string }

// accounts are the cost and cache counters, made on first use.
type accounts struct {
	mu   sync.Mutex
	cost map[costKey]*vm.FloatCounter
	read map[costKey]*vm.Counter
	wrot map[costKey]*vm.Counter
}

// processAccounts is shared by every generation: the counters live for the
// process, as the series' do.
var processAccounts = &accounts{cost: map[costKey]*vm.FloatCounter{}, read: map[costKey]*vm.Counter{}, wrot: map[costKey]*vm.Counter{}}

// account counts r's cost and cached tokens under its series' route and
// model and its tenant.
func account(r *Record) {
	x := r.Series
	if x == nil || (r.CostUSD <= 0 && r.CachedTokens <= 0 && r.CacheWriteTokens <= 0) {
		return
	}
	tenant := r.Tenant
	a := processAccounts
	a.mu.Lock()
	defer a.mu.Unlock()
	if r.CostUSD > 0 {
		k := costKey{x.route, x.model, tenant}
		c := a.cost[k]
		if c == nil {
			c = vm.GetOrCreateFloatCounter(`tokentap_cost_usd_total{route="` + k.route + `",model="` + k.model + `",tenant="` + k.tenant + `"}`)
			a.cost[k] = c
		}
		c.Add(r.CostUSD)
	}
	k := costKey{x.route, x.model, ""}
	if r.CachedTokens > 0 {
		c := a.read[k]
		if c == nil {
			c = vm.GetOrCreateCounter(`tokentap_cached_tokens_total{route="` + k.route + `",model="` + k.model + `"}`)
			a.read[k] = c
		}
		c.Add(r.CachedTokens)
	}
	if r.CacheWriteTokens > 0 {
		c := a.wrot[k]
		if c == nil {
			c = vm.GetOrCreateCounter(`tokentap_cache_write_tokens_total{route="` + k.route + `",model="` + k.model + `"}`)
			a.wrot[k] = c
		}
		c.Add(r.CacheWriteTokens)
	}
}
