package proxy

import (
	"bytes"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/ratelimit"
	"github.com/tokentap/tokentap/sse/dialect"
	"github.com/valyala/fasthttp"
)

// tenantHeader carries the tenant tokentap identified to the upstream.
// Inbound copies are always dropped, so a client cannot claim a tenant.
const tenantHeader = "X-Tokentap-Tenant"

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

// identify returns the request's tenant under admission control, or false
// when it is unknown and unknown keys are refused.
func identify(a *ratelimit.Admitter, h *fasthttp.RequestHeader) (string, bool) {
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

// estimate is what a request reserves of its tenant's token budget before
// it is forwarded: its input, estimated without a tokenizer at 4 bytes of
// body per token, and its declared output limit (or the configured
// default). The reservation is reconciled with the real usage at the end.
func estimate(body []byte, d dialect.Dialect, defaultOut int) (in, total int64) {
	in = int64(len(body) / 4)
	out := int64(dialect.MaxOutputTokens(body))
	if out == 0 && d != dialect.Embeddings {
		out = int64(defaultOut)
	}
	return in, in + out
}

// setQuotaHeaders sets the OpenAI-style x-ratelimit-* headers from the
// tenant's limiter state.
func setQuotaHeaders(h *fasthttp.ResponseHeader, a *ratelimit.Admitter, tenant, route string) {
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
