// Package admission decides whether a request goes, in the order it
// lives: the tenant it is identified as (Identify), what it is estimated
// to use (Estimate), its tenant's limits that admit or queue it (a
// ratelimit.Admitter: NewAdmitter, with its series), then, once its
// upstream is chosen and it is counted in flight there, whether that
// upstream would serve it within its objectives (Overload: its priority,
// its objectives, Judge, on the upstream's shed.Gate and the predict
// model under it). It refuses nothing itself: the exchange answers.
package admission

import (
	"bytes"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// TenantHeader carries the tenant tokentap identified to the upstream.
// Inbound copies are always dropped, so a client cannot claim a tenant.
const TenantHeader = "X-Tokentap-Tenant"

// apiKey returns the key a request presents: Authorization: Bearer, then
// x-api-key (Anthropic), api-key (Azure OpenAI), x-goog-api-key (Gemini).
func apiKey(h *fasthttp.RequestHeader) []byte {
	if v := h.Peek("Authorization"); len(v) > 7 && bytes.EqualFold(v[:7], []byte("bearer ")) {
		return bytes.TrimSpace(v[7:])
	}
	for _, name := range [...]string{"X-Api-Key", "Api-Key", "X-Goog-Api-Key"} {
		if v := h.Peek(name); len(v) > 0 {
			return v
		}
	}
	return nil
}

// Identify returns the request's tenant under admission control, or false
// when it is unknown and unknown keys are refused.
func Identify(a *ratelimit.Admitter, h *fasthttp.RequestHeader) (string, bool) {
	cfg := a.Config()
	if cfg.TrustedTenantHeader != "" {
		if name := h.Peek(cfg.TrustedTenantHeader); len(name) > 0 && a.Has(string(name)) {
			return string(name), true
		}
	} else if key := apiKey(h); len(key) > 0 {
		if name, ok := a.Identify(key); ok {
			return name, true
		}
	}
	if cfg.UnknownKey != "" && cfg.UnknownKey != "reject" {
		return cfg.UnknownKey, true
	}
	return "", false
}

// Estimate is what a request reserves of its tenant's token budget before
// it is forwarded: its input, estimated without a tokenizer at 4 bytes of
// body per token, and its declared output limit (or the configured
// default). The reservation is reconciled with the real usage at the end.
func Estimate(body []byte, d dialect.Dialect, defaultOut int) (in, total int64) {
	in = int64(len(body) / 4)
	out := int64(dialect.MaxOutputTokens(body))
	if out == 0 && d != dialect.Embeddings {
		out = int64(defaultOut)
	}
	return in, in + out
}

// SetQuotaHeaders sets the OpenAI-style x-ratelimit-* headers from the
// tenant's limiter state.
func SetQuotaHeaders(h *fasthttp.ResponseHeader, a *ratelimit.Admitter, tenant, route string) {
	req, tok := a.Quotas(tenant, route)
	set := func(kind string, q ratelimit.Quota) {
		if !q.Set {
			return
		}
		h.Set("X-Ratelimit-Limit-"+kind, strconv.FormatInt(q.Limit, 10))
		h.Set("X-Ratelimit-Remaining-"+kind, strconv.FormatInt(q.Remaining, 10))
		h.Set("X-Ratelimit-Reset-"+kind, q.Reset.Round(time.Millisecond).String())
	}
	set("Requests", req)
	set("Tokens", tok)
}

// NewAdmitter makes the admitter of a new configuration generation by
// cfg, taking over the tenants' state of prev's (nil: none), and publishes
// its series in set; without admission (cfg nil) it closes prev and
// returns nil.
func NewAdmitter(cfg *ratelimit.Config, prev *ratelimit.Admitter, now func() time.Time, set *metrics.Set) *ratelimit.Admitter {
	if cfg == nil {
		if prev != nil {
			prev.Close()
		}
		return nil
	}
	a := ratelimit.New(*cfg, now, prev)
	tenants := make([]string, len(cfg.Tenants))
	for i, t := range cfg.Tenants {
		tenants[i] = t.Name
	}
	reasons := make([]string, len(ratelimit.Reasons))
	for i, r := range ratelimit.Reasons {
		reasons[i] = string(r)
	}
	set.AddTenants(tenants, reasons, a.Stats)
	if a.StoreStats().Present {
		b2f := func(b bool) float64 {
			if b {
				return 1
			}
			return 0
		}
		set.AddGauge("tokentap_admission_store_up", func() float64 { return b2f(a.StoreStats().Up) })
		set.AddGauge("tokentap_admission_store_calls", func() float64 { return float64(a.StoreStats().Calls) })
		set.AddGauge("tokentap_admission_store_call_failures", func() float64 { return float64(a.StoreStats().Failures) })
		set.AddGauge("tokentap_admission_store_call_seconds", func() float64 { return a.StoreStats().Seconds })
		set.AddGauge("tokentap_admission_store_replicas", func() float64 { return float64(a.StoreStats().Replicas) })
		set.AddGauge("tokentap_admission_store_releases_pending", func() float64 { return float64(a.StoreStats().ReleasesPending) })
		set.AddGauge("tokentap_admission_store_releases_dropped", func() float64 { return float64(a.StoreStats().ReleasesDropped) })
		set.AddGauge("tokentap_admission_store_releases_retried", func() float64 { return float64(a.StoreStats().ReleasesRetried) })
	}
	return a
}
