package measure

import (
	"fmt"
	"math"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/conf"
)

// Price is what a model's tokens cost, in dollars per million tokens.
// CachedInput is a prompt-cache read's price and CacheWrite a cache
// write's; below 0 (unset) they cost as Input.
type Price struct {
	// Model is a glob (* any run, ? one character) matched against the
	// model the request names (else the one the response names); the
	// first price that matches is the model's.
	Model                                  string
	Input, CachedInput, CacheWrite, Output float64
}

// PriceOf returns the first of prices whose glob matches model (nil: none).
// A model that is empty (a body tokentap cannot read: not JSON, encoded,
// a model that is no string) is priced by a catch-all glob ("*") like an
// unknown one.
func PriceOf(prices []Price, model string) *Price {
	for i := range prices {
		if conf.Glob(prices[i].Model, model) {
			return &prices[i]
		}
	}
	return nil
}

// cost is what in input tokens (cached of them read from the prompt cache
// and written of them written to it) and out output tokens cost, in
// dollars.
func (p *Price) cost(in, cached, written, out int) float64 {
	read, write := p.CachedInput, p.CacheWrite
	if read < 0 {
		read = p.Input
	}
	if write < 0 {
		write = p.Input
	}
	fresh := max(in-cached-written, 0)
	return (float64(fresh)*p.Input + float64(cached)*read + float64(written)*write + float64(out)*p.Output) / 1e6
}

// ValidPrices checks the price list: each with a model and no negative
// price (a price left out is given as −1 and costs as input).
func ValidPrices(prices []Price) error {
	for i, p := range prices {
		field := func(f string) string { return fmt.Sprintf("prices[%d].%s", i, f) }
		if p.Model == "" {
			return conf.Errf(field("model"), "must name a model (a glob: gpt-4o*)")
		}
		for _, v := range []struct {
			name string
			v    float64
			opt  bool
		}{{"input", p.Input, false}, {"output", p.Output, false}, {"cached_input", p.CachedInput, true}, {"cache_write", p.CacheWrite, true}} {
			if math.IsNaN(v.v) || math.IsInf(v.v, 0) || v.v < 0 && !(v.opt && v.v == -1) {
				return conf.Errf(field(v.name), "must be a price in dollars per million tokens, 0 or more")
			}
		}
	}
	return nil
}

// RoutePrices are the prices that may apply to a route's requests: for a
// route that names models, those whose glob meets one of its globs (each
// read as a name of the other's; all of them when none does), else all.
// The dearest of them prices a request whose model has no price when its
// tenant has a dollar budget (charge).
func RoutePrices(prices []Price, models []string) []*Price {
	var ps []*Price
	for i := range prices {
		p := &prices[i]
		meets := len(models) == 0
		for _, g := range models {
			meets = meets || conf.Glob(p.Model, g) || conf.Glob(g, p.Model)
		}
		if meets {
			ps = append(ps, p)
		}
	}
	if len(ps) == 0 && len(models) > 0 {
		return RoutePrices(prices, nil)
	}
	return ps
}

// Charge is how a request is priced: at its served model's price, or,
// where that has none and its tenant has a dollar budget, at the dearest
// price of its route for what it used (a body tokentap cannot read, or a
// model left unpriced, never spends a budget for free); else unpriced.
type Charge struct {
	Price   *Price    // the served model's (nil: none)
	Dearest *[]*Price // its route's prices, when they stand in for it
}

// basis says which price a record's cost is at (metrics.Cost*).
func (c Charge) basis() string {
	switch {
	case c.Price != nil:
		return metrics.CostModel
	case c.Dearest != nil && len(*c.Dearest) > 0:
		return metrics.CostDearest
	}
	return metrics.CostUnpriced
}

// priced reports whether the charge gives a cost.
func (c Charge) priced() bool { return c.basis() != metrics.CostUnpriced }

// Cost is what in input tokens (cached and written of them to the prompt
// cache) and out output tokens cost under the charge: the model's price,
// or the dearest of the route's for these figures.
func (c Charge) Cost(in, cached, written, out int) float64 {
	if c.Price != nil {
		return c.Price.cost(in, cached, written, out)
	}
	var most float64
	if c.Dearest == nil {
		return 0
	}
	for _, p := range *c.Dearest {
		most = max(most, p.cost(in, cached, written, out))
	}
	return most
}

// used is what a request that used u (its output out) cost, its input
// estimated from bytesIn where the usage does not say.
func (c Charge) used(u *usage, bytesIn int64, out int) float64 {
	return c.Cost(u.input(bytesIn), u.cached, u.write, out)
}

// PriceRecord fills the record's cost under c (unpriced: CostUSD stays
// absent, its basis says so). A request that reached no upstream cost
// nothing; one without a usage block is priced from what was counted and
// estimated (its UsageSource says so).
func PriceRecord(rec *metrics.Record, c Charge, tp *Tap, anyPrices bool) {
	u := &tp.m.usage
	if rec.Attempts == 0 {
		rec.UsageSource = ""
		if c.priced() {
			rec.Cost.USD = 0
		}
		return
	}
	if anyPrices {
		rec.Cost.Basis = c.basis()
	}
	if c.priced() {
		rec.Cost.USD = c.used(u, rec.BytesIn, rec.OutputTokens)
	}
}
