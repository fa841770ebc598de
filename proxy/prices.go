package proxy

import (
	"fmt"
	"math"

	"github.com/tokentap/tokentap/metrics"
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

// priceOf returns the first price whose glob matches model (nil: none).
func (c *Config) priceOf(model string) *Price {
	if model == "" {
		return nil
	}
	for i := range c.Prices {
		if globMatch(c.Prices[i].Model, model) {
			return &c.Prices[i]
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

// validPrices checks the price list: each with a model and no negative
// price (a price left out is given as −1 and costs as input).
func validPrices(prices []Price) error {
	for i, p := range prices {
		field := func(f string) string { return fmt.Sprintf("prices[%d].%s", i, f) }
		if p.Model == "" {
			return fieldErr(field("model"), "must name a model (a glob: gpt-4o*)")
		}
		for _, v := range []struct {
			name string
			v    float64
			opt  bool
		}{{"input", p.Input, false}, {"output", p.Output, false}, {"cached_input", p.CachedInput, true}, {"cache_write", p.CacheWrite, true}} {
			if math.IsNaN(v.v) || math.IsInf(v.v, 0) || v.v < 0 && !(v.opt && v.v == -1) {
				return fieldErr(field(v.name), "must be a price in dollars per million tokens, 0 or more")
			}
		}
	}
	return nil
}

// used is what a request that used u (its output out) cost, its input
// estimated from bytesIn where the usage does not say.
func (p *Price) used(u *usage, bytesIn int64, out int) float64 {
	return p.cost(u.input(bytesIn), u.cached, u.write, out)
}

// priceRecord fills the record's cost at p (nil: no price, CostUSD stays
// absent). A request that reached no upstream cost nothing; one without a
// usage block is priced from what was counted and estimated (its
// UsageSource says so).
func priceRecord(rec *metrics.Record, p *Price, u *usage) {
	if rec.Attempts == 0 {
		rec.UsageSource = ""
		if p != nil {
			rec.CostUSD = 0
		}
		return
	}
	if p != nil {
		rec.CostUSD = p.used(u, rec.BytesIn, rec.OutputTokens)
	}
}
