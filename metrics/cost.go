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
//	tokentap_unpriced_requests_total{route,charged}  charged: route_max, no
//	tokentap_usage_rejected_total{route}             usage that could not be true
//	tokentap_cached_tokens_total{route,model}
//	tokentap_cache_write_tokens_total{route,model}
//	tokentap_cache_reported_requests_total{route,cache}      cache: hit, miss
//	tokentap_cache_reported_ttft_seconds_total{route,cache}  their first tokens
//
// The label values are bounded as the series' are: routes and tenants from
// the configuration, models from its allowlist (others are "other").

// handleKey names one counter of the accounts: its family and labels.
type handleKey struct{ family, route, second, tenant string }

// handles holds the accounts' counters by handleKey, made on first use
// and then read without a lock (a record of every request passes here).
var handles sync.Map

// handle returns the counter of k, made by mk (which names its series)
// on first use.
func handle[C any](k handleKey, mk func() C) C {
	if c, ok := handles.Load(k); ok {
		return c.(C)
	}
	c, _ := handles.LoadOrStore(k, mk())
	return c.(C)
}

// account counts r's cost and cached tokens under its series' route and
// model and its tenant.
func account(r *Record) {
	x := r.Series
	if x != nil && r.UsageSource == UsageRejected {
		handle(handleKey{"usage_rejected", x.route, "", ""}, func() *vm.Counter {
			return vm.GetOrCreateCounter(`tokentap_usage_rejected_total{route="` + x.route + `"}`)
		}).Inc()
	}
	if x != nil && r.Cost.Basis != "" && r.Cost.Basis != CostModel {
		// A request its model's price did not price: charged at its
		// route's dearest, or not at all.
		basis := r.Cost.Basis
		handle(handleKey{"unpriced", x.route, basis, ""}, func() *vm.Counter {
			return vm.GetOrCreateCounter(`tokentap_unpriced_requests_total{route="` + x.route + `",charged="` + map[string]string{CostDearest: "route_max", CostUnpriced: "no"}[basis] + `"}`)
		}).Inc()
	}
	reported := r.CachedTokens >= 0 && r.Stream && r.TTFT >= 0
	if x == nil || (r.Cost.USD <= 0 && r.CachedTokens <= 0 && r.CacheWriteTokens <= 0 && !reported) {
		return
	}
	// The series' names are made on first use only (no string per request).
	labels := func() string { return `route="` + x.route + `",model="` + x.model + `"` }
	if r.Cost.USD > 0 {
		handle(handleKey{"cost", x.route, x.model, r.Tenant}, func() *vm.FloatCounter {
			return vm.GetOrCreateFloatCounter(`tokentap_cost_usd_total{` + labels() + `,tenant="` + r.Tenant + `"}`)
		}).Add(r.Cost.USD)
	}
	if r.CachedTokens > 0 {
		handle(handleKey{"read", x.route, x.model, ""}, func() *vm.Counter {
			return vm.GetOrCreateCounter(`tokentap_cached_tokens_total{` + labels() + `}`)
		}).Add(r.CachedTokens)
	}
	if r.CacheWriteTokens > 0 {
		handle(handleKey{"write", x.route, x.model, ""}, func() *vm.Counter {
			return vm.GetOrCreateCounter(`tokentap_cache_write_tokens_total{` + labels() + `}`)
		}).Add(r.CacheWriteTokens)
	}
	if reported {
		cache := "miss"
		if r.CachedTokens > 0 {
			cache = "hit"
		}
		byCache := func() string { return `{route="` + x.route + `",cache="` + cache + `"}` }
		handle(handleKey{"hits", x.route, cache, ""}, func() *vm.Counter {
			return vm.GetOrCreateCounter(`tokentap_cache_reported_requests_total` + byCache())
		}).Inc()
		handle(handleKey{"hit_seconds", x.route, cache, ""}, func() *vm.FloatCounter {
			return vm.GetOrCreateFloatCounter(`tokentap_cache_reported_ttft_seconds_total` + byCache())
		}).Add(r.TTFT.Seconds())
	}
}
