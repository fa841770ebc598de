package metrics

import (
	"fmt"

	vm "github.com/VictoriaMetrics/metrics"
)

// TenantSeries is the handles of one tenant's metrics (label tenant).
type TenantSeries struct {
	requests            [numOutcomes]*vm.Counter // by outcome
	outTokens, inTokens *vm.Counter
	rejected            []*vm.Counter // by reason, as given to AddTenants
	reasons             []string
}

// AddTenants adds per-tenant series to s: requests by outcome, tokens,
// admission refusals by reason, and two gauges read at scrape time from
// stats (requests in flight and queued). Tenant names come from the config,
// so the number of series is bounded by it.
func (s *Set) AddTenants(names, reasons []string, stats func(tenant string) (inflight, queued int64)) {
	s.tenants = make(map[string]*TenantSeries, len(names))
	for _, name := range names {
		l := fmt.Sprintf(`tenant=%q`, name)
		t := &TenantSeries{
			outTokens: durable.GetOrCreateCounter("tokentap_tenant_output_tokens_total{" + l + "}"),
			inTokens:  durable.GetOrCreateCounter("tokentap_tenant_input_tokens_total{" + l + "}"),
			reasons:   reasons,
		}
		for i, o := range Outcomes {
			t.requests[i] = durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_tenant_requests_total{%s,outcome=%q}`, l, o))
		}
		for _, r := range reasons {
			t.rejected = append(t.rejected, durable.GetOrCreateCounter(fmt.Sprintf(`tokentap_admission_rejected_total{%s,reason=%q}`, l, r)))
		}
		name := name
		s.set.NewGauge("tokentap_tenant_inflight{"+l+"}", func() float64 { in, _ := stats(name); return float64(in) })
		s.set.NewGauge("tokentap_tenant_queue_depth{"+l+"}", func() float64 { _, q := stats(name); return float64(q) })
		s.tenants[name] = t
	}
}

// Tenant returns the series of a tenant, or nil.
func (s *Set) Tenant(name string) *TenantSeries { return s.tenants[name] }

// Rejected counts one admission refusal.
func (t *TenantSeries) Rejected(reason string) {
	if t == nil {
		return
	}
	for i, r := range t.reasons {
		if r == reason {
			t.rejected[i].Inc()
			return
		}
	}
}

func (t *TenantSeries) observe(r *Record) {
	t.requests[outcomeIndex(r.Outcome)].Inc()
	if r.OutputTokens > 0 {
		t.outTokens.Add(r.OutputTokens)
	}
	if r.InputTokens > 0 {
		t.inTokens.Add(r.InputTokens)
	}
}
