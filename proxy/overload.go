package proxy

import (
	"bytes"
	"fmt"
	"strconv"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"github.com/tokentap/tokentap/proxy/shed"
)

// Overload is a route's overload control (proxy/shed). With Shed, a
// request its upstream is predicted not to serve within its objectives
// (the route's, its tenant's, or with SLOHeaders its own) is refused at
// once, before its body is read: 529 overloaded_error on Anthropic routes,
// 503 on the others, with Retry-After when the queue is predicted to have
// drained. Lower priorities go first; a critical request is refused only
// when it would not get a first token before the route's first-byte
// timeout at all. A shed request counts against goodput: refusing is no
// way to meet an SLO.
type Overload struct {
	// Shed turns the refusals on (the predictions are made either way).
	Shed bool
	// PriorityHeader names the request header that says a request's
	// priority (critical, standard, sheddable; anything else: standard).
	// A tenant's priority (Config.TenantPriorities) is the most its
	// requests may claim: the header may lower it, never raise it. Without
	// tenants to cap it the header claims at most standard, unless
	// TrustPriorityHeader (every client, or a gateway in front that sets
	// it, may be believed).
	PriorityHeader      string
	TrustPriorityHeader bool
	// SLOHeaders lets a request set its own objectives for the decision
	// (X-SLO-TTFT-Ms, X-SLO-TPOT-Ms), over the route's and its tenant's.
	SLOHeaders bool
}

// Priority is a request's place under overload (proxy/shed).
type Priority = shed.Priority

// The priorities, most important first.
const (
	PriorityCritical  = shed.Critical
	PriorityStandard  = shed.Standard
	PrioritySheddable = shed.Sheddable
)

// ParsePriority reads a priority's name.
func ParsePriority(s string) (Priority, bool) { return shed.ParsePriority(s) }

// The request headers of a request's own objectives (Overload.SLOHeaders).
var (
	headerSLOTTFT = []byte("X-SLO-TTFT-Ms")
	headerSLOTPOT = []byte("X-SLO-TPOT-Ms")
)

// validOverload checks route r's overload control against the objectives
// it could judge by.
func (c *Config) validOverload(r Route, field func(string) string) error {
	o := r.Overload
	if o == nil || !o.Shed {
		return nil
	}
	slo := c.SLO.Over(r.SLO)
	judged := slo.TTFT > 0 || slo.TPOT > 0 || slo.E2E > 0 || o.SLOHeaders
	for _, t := range c.TenantSLOs {
		judged = judged || t.TTFT > 0 || t.TPOT > 0 || t.E2E > 0
	}
	if !judged {
		return conf.Errf(field("overload.shed"), "sheds by the TTFT and TPOT objectives (streams) and the E2E objective (whole responses), and the route has none: set slo.ttft, slo.tpot or slo.e2e (on the route, the default or its tenants), or overload.slo_headers")
	}
	if o.PriorityHeader != "" && !conf.IsToken(o.PriorityHeader) {
		return conf.Errf(field("overload.priority_header"), "%q is not a header name", o.PriorityHeader)
	}
	return nil
}

// Warnings lists what a valid configuration says that may not do what was
// meant: each a field and why, printed by -check and logged when the
// configuration is applied.
func (c *Config) Warnings() []string {
	var ws []string
	warn := func(field, format string, args ...any) { ws = append(ws, field+": "+fmt.Sprintf(format, args...)) }
	tenants := c.Admission != nil && len(c.Admission.Tenants) > 0
	keyed := tenants && c.Admission.TrustedTenantHeader == ""
	anyModel := false
	for i, r := range c.Routes {
		field := func(f string) string { return fmt.Sprintf("routes[%d].%s", i, f) }
		anyModel = anyModel || len(r.Models) == 0
		if o := r.Overload; o != nil {
			switch {
			case o.PriorityHeader != "" && !tenants && !o.TrustPriorityHeader:
				warn(field("overload.priority_header"), "with no tenants to cap it, the header claims at most standard (any client could claim critical); set overload.trust_priority_header: true where every client may be believed")
			case o.TrustPriorityHeader && o.PriorityHeader == "":
				warn(field("overload.trust_priority_header"), "takes no effect without overload.priority_header")
			case o.TrustPriorityHeader && tenants:
				warn(field("overload.trust_priority_header"), "takes no effect with tenants: each tenant's priority caps its requests")
			}
		}
		if r.ForwardClientKey && !keyed {
			warn(field("forward_client_key"), "takes no effect: the client's key headers are dropped only where tenants are known by key")
		}
	}
	// A price whose glob meets no route's models (all routes name theirs)
	// prices nothing a route serves by name (a response may still name
	// another model: hence a warning).
	for i, p := range c.Prices {
		used := anyModel
		for _, r := range c.Routes {
			for _, g := range r.Models {
				used = used || conf.Glob(p.Model, g) || conf.Glob(g, p.Model)
			}
		}
		if !used {
			warn(fmt.Sprintf("prices[%d].model", i), "%q meets no model a route names: no request is priced by it unless its response names such a model", p.Model)
		}
	}
	return ws
}

// headerMS reads a whole number of milliseconds (0: absent or not one).
func headerMS(v []byte) time.Duration {
	n, err := strconv.Atoi(string(bytes.TrimSpace(v)))
	if err != nil || n <= 0 || n > 3_600_000 {
		return 0
	}
	return time.Duration(n) * time.Millisecond
}

// fillShares puts in o upstream m's share of route r's requests and what
// its backend said of its prompt cache, since the configuration.
func fillShares(o *stats.Overload, r *route, m *member) {
	var all int64
	for _, n := range r.members {
		all += n.picked()
	}
	if all > 0 {
		o.Share = float64(m.picked()) / float64(all)
	}
	for i := range m.why {
		if n := m.why[i].Load(); n > 0 {
			if o.Why == nil {
				o.Why = map[string]int64{}
			}
			o.Why[pickReasonNames[i]] = n
		}
	}
	if m.scrape != nil {
		o.Backend = &stats.BackendState{Running: -1, Waiting: -1, KVCache: -1, Error: "not scraped yet"}
		if st := m.scrape.state.Load(); st != nil {
			o.Backend = &stats.BackendState{Running: st.Running, Waiting: st.Waiting, KVCache: st.KV, Error: st.Err,
				AgeS: m.scrape.now().Sub(st.At).Seconds()}
		}
	}
	c := &m.cache
	o.CacheReported, o.TTFTHitMs, o.TTFTMissMs = c.reported.Load(), -1, -1
	if o.CacheReported > 0 {
		o.CacheHitShare = float64(c.hits.Load()) / float64(o.CacheReported)
	}
	if n := c.hitTTFTn.Load(); n > 0 {
		o.TTFTHitMs = float64(c.hitTTFTus.Load()) / float64(n) / 1000
	}
	if n := c.missTTFTn.Load(); n > 0 {
		o.TTFTMissMs = float64(c.missTTFTus.Load()) / float64(n) / 1000
	}
}
