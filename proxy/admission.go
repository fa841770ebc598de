package proxy

import (
	"bytes"
	"context"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics"
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

// admit runs admission control for a request of an identified tenant
// (x.tenant); false means the request was answered (429 or a cancel) and
// is finished.
func (p *Proxy) admit(ctx *fasthttp.RequestCtx, x *exchange, body []byte) bool {
	a := x.snap.admit
	tenant := x.tenant
	var total int64
	x.estIn, total = estimate(body, x.dialect, x.snap.cfg.DefaultMaxOutput)

	start := p.now()
	ticket, refusal := a.Admit(goneCtx{x.cancel.doneChan()}, tenant, x.route.Name, total)
	x.rec.Queue = p.now().Sub(start)
	if refusal == nil {
		x.ticket = ticket
		return true
	}
	x.rec.TenantSeries.Rejected(string(refusal.Reason))
	if refusal.Reason == ratelimit.ReasonCancelled {
		p.fail(ctx, x, 499, metrics.OutcomeClientCancel, "", "client closed the connection while queued")
		return false
	}
	x.rec.Status, x.rec.Outcome = fasthttp.StatusTooManyRequests, metrics.OutcomeRejected
	x.rec.Error = "rate limited: " + string(refusal.Reason)
	writeJSONError(ctx, fasthttp.StatusTooManyRequests, "rate_limit_exceeded", "rate limit reached ("+string(refusal.Reason)+"), retry later", x.id)
	secs := int64((refusal.RetryAfter + time.Second - 1) / time.Second)
	ctx.Response.Header.Set("Retry-After", strconv.FormatInt(max(secs, 1), 10))
	setQuotaHeaders(&ctx.Response.Header, a, tenant, x.route.Name)
	x.finish(nil)
	return false
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

// releaseTicket returns the request's admission ticket with the tokens it
// really used: the usage the backend reported, or the input estimate and
// the output tokens counted; nothing when no response came or the backend
// refused the request without usage.
func (x *exchange) releaseTicket() {
	if x.ticket == nil {
		return
	}
	var actual int64
	if x.responded && (x.rec.Status < 400 || x.m.usage.hasIn || x.m.usage.hasOut) {
		in := x.estIn
		if x.m.usage.hasIn {
			in = int64(x.m.usage.in)
		}
		actual = in + int64(x.rec.OutputTokens)
	}
	x.ticket.Release(actual)
	x.ticket = nil
}

// goneCtx is a context that is done when the client has gone.
type goneCtx struct{ done <-chan struct{} }

func (goneCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c goneCtx) Done() <-chan struct{}     { return c.done }
func (goneCtx) Value(any) any               { return nil }
func (c goneCtx) Err() error {
	select {
	case <-c.done:
		return context.Canceled
	default:
		return nil
	}
}
