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
//	tokentap_cache_reported_requests_total{route,cache}      cache: hit, miss
//	tokentap_cache_reported_ttft_seconds_total{route,cache}  their first tokens
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
	// By route and whether the backend served part of the prompt from its
	// cache (model "hit" or "miss" in the key): streamed requests whose
	// backend said, and their first tokens' seconds summed, for the mean
	// TTFT with a cache hit against without.
	hitN   map[costKey]*vm.Counter
	hitSec map[costKey]*vm.FloatCounter
}

// processAccounts is shared by every generation: the counters live for the
// process, as the series' do.
var processAccounts = &accounts{cost: map[costKey]*vm.FloatCounter{}, read: map[costKey]*vm.Counter{}, wrot: map[costKey]*vm.Counter{},
	hitN: map[costKey]*vm.Counter{}, hitSec: map[costKey]*vm.FloatCounter{}}

// account counts r's cost and cached tokens under its series' route and
// model and its tenant.
func account(r *Record) {
	x := r.Series
	reported := r.CachedTokens >= 0 && r.UsageSource == UsageProvider && r.Stream && r.TTFT >= 0
	if x == nil || (r.CostUSD <= 0 && r.CachedTokens <= 0 && r.CacheWriteTokens <= 0 && !reported) {
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
	if reported {
		cache := "miss"
		if r.CachedTokens > 0 {
			cache = "hit"
		}
		hk := costKey{x.route, cache, ""}
		n, sec := a.hitN[hk], a.hitSec[hk]
		if n == nil {
			n = vm.GetOrCreateCounter(`tokentap_cache_reported_requests_total{route="` + hk.route + `",cache="` + cache + `"}`)
			sec = vm.GetOrCreateFloatCounter(`tokentap_cache_reported_ttft_seconds_total{route="` + hk.route + `",cache="` + cache + `"}`)
			a.hitN[hk], a.hitSec[hk] = n, sec
		}
		n.Inc()
		sec.Add(r.TTFT.Seconds())
	}
}
