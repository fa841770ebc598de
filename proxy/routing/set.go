package routing

import (
	"strings"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
	"github.com/tokentap/tokentap/proxy/internal/conf"
	"go.uber.org/zap"
)

// Set is a route's upstreams at run time and how a request's is chosen
// among them: a chain of selectors, each choosing or passing to the next
// (prefix affinity, then least predicted TTFT, then the balance), built
// once by NewSet. Its members and guard are fixed for the configuration's
// life; their counts are atomic.
type Set struct {
	members         []*Member // its upstreams: one, or Route.Upstreams
	weights         int       // the members' weights summed
	guard           *guardState
	aff             *affinity // sticky: prefix: the hash ring and the loads (affinity.go)
	chain           []Selector
	route           string // the route's name, for the guard's word
	balance, sticky string
	models          bool // the route names models
}

// Options are what a route says of how its upstream is chosen.
type Options struct {
	Route   string // its name
	Balance string // BalanceWeighted (""), BalanceLeastInflight or BalanceLeastTTFT
	Sticky  string // "tenant", "header:NAME", StickyPrefix or ""
	Models  bool   // the route names models: its upstream is chosen once the body is read
	Guard   *Guard // nil: none
}

// Validate checks a route's balance and stickiness; its errors name the
// field under field.
func (o Options) Validate(field func(string) string) error {
	switch o.Balance {
	case "", BalanceWeighted, BalanceLeastInflight, BalanceLeastTTFT:
	default:
		return conf.Errf(field("balance"), "must be %s, %s or %s, got %q", BalanceWeighted, BalanceLeastInflight, BalanceLeastTTFT, o.Balance)
	}
	if h, ok := strings.CutPrefix(o.Sticky, "header:"); o.Sticky != "" && o.Sticky != "tenant" && o.Sticky != StickyPrefix && (!ok || !conf.IsToken(h)) {
		return conf.Errf(field("sticky"), "must be tenant, prefix or header:NAME, got %q", o.Sticky)
	}
	return nil
}

// NewSet makes the run-time set of a route's members, under o, its guard
// armed at now.
func NewSet(members []*Member, o Options, now time.Time) *Set {
	s := &Set{members: members, route: o.Route, balance: o.Balance, sticky: o.Sticky, models: o.Models}
	for _, m := range members {
		s.weights += m.Weight
	}
	if o.Sticky == StickyPrefix {
		s.aff = newAffinity(members)
		s.chain = append(s.chain, PrefixAffinity{})
	}
	if o.Balance == BalanceLeastTTFT {
		s.chain = append(s.chain, LeastTTFT{})
	}
	s.chain = append(s.chain, Balance{})
	if o.Guard != nil {
		g := newGuardState(*o.Guard, now)
		g.candidate = s.Member(g.Candidate)
		s.guard = g
	}
	return s
}

// Members are the route's upstreams, in the configuration's order.
func (s *Set) Members() []*Member { return s.members }

// Member returns the upstream named name (validated to exist), or nil.
func (s *Set) Member(name string) *Member {
	for _, m := range s.members {
		if m.Name == name {
			return m
		}
	}
	return nil
}

// CloseIdle closes the idle connections of every upstream.
func (s *Set) CloseIdle() {
	for _, m := range s.members {
		m.Up.CloseIdle()
	}
}

// Scrapers calls f with each upstream's scraper.
func (s *Set) Scrapers(f func(*Scraper)) {
	for _, m := range s.members {
		if m.Scrape != nil {
			f(m.Scrape)
		}
	}
}

// Guarded tells the guard of a record of upstream m (nil: none) and of
// the sticky key that chose it (keyed), and has it look, at most once
// per guardInterval, at whether the candidate is worse, on the clock now:
// a tripped guard says so to log.
func (s *Set) Guarded(m *Member, rec *metrics.Record, key uint64, keyed bool, clock func() time.Time, log *zap.Logger) {
	g := s.guard
	if g == nil {
		return
	}
	now := clock()
	if m != nil {
		g.observe(m.Name, rec)
	}
	if keyed {
		g.noteKey(m.Name, key, now)
	}
	g.check(s.route, s.sticky != "", now, log)
}

// Late reports whether the route's upstream is chosen once the request's
// body is read: by the model it names, or by its input (its prompt's
// prefix, its predicted TTFT).
func (s *Set) Late() bool {
	if len(s.members) < 2 {
		return s.models
	}
	return s.models || s.sticky == StickyPrefix || s.balance == BalanceLeastTTFT && s.sticky == ""
}

// Predicts reports whether the route's upstreams keep a prediction and
// show in /stats' overload table to balance by it, or beside prefix
// affinity (or for overload control, which the route knows of).
func (s *Set) Predicts() bool {
	if s.balance == BalanceLeastTTFT || s.sticky == StickyPrefix {
		return true
	}
	for _, m := range s.members {
		if m.Scrape != nil {
			return true
		}
	}
	return false
}

// CacheReported reports whether a backend of the route said what its
// prompt cache served.
func (s *Set) CacheReported() bool {
	for _, m := range s.members {
		if m.Cache.reported.Load() > 0 {
			return true
		}
	}
	return false
}

// Weight is m's share of new requests now: its configured weight, or 0
// for the candidate of a tripped guard (unless no other upstream takes
// requests: they keep flowing).
func (s *Set) Weight(m *Member) int {
	if g := s.guard; g != nil && m == g.candidate && s.weights > m.Weight && g.tripped.Load() != nil {
		return 0
	}
	return m.Weight
}

// byWeight returns the member whose share of [0, the weights now) holds at.
func (s *Set) byWeight(at int) *Member {
	for _, m := range s.members {
		w := s.Weight(m)
		if at < w {
			return m
		}
		at -= w
	}
	return s.members[len(s.members)-1]
}

// FillShares puts in o upstream m's share of the route's requests, why
// they went there, and what its backend said of its queue and its prompt
// cache, since the configuration.
func (s *Set) FillShares(o *stats.Overload, m *Member) {
	var all int64
	for _, n := range s.members {
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
			o.Why[reasonNames[i]] = n
		}
	}
	if m.Scrape != nil {
		o.Backend = &stats.BackendState{Running: -1, Waiting: -1, KVCache: -1, Error: "not scraped yet"}
		if st := m.Scrape.state.Load(); st != nil {
			o.Backend = &stats.BackendState{Running: st.Running, Waiting: st.Waiting, KVCache: st.KV, Error: st.Err,
				AgeS: m.Scrape.now().Sub(st.At).Seconds()}
		}
	}
	c := &m.Cache
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
