package stats

import (
	"sync"
	"time"

	"github.com/DataDog/sketches-go/ddsketch"
	"github.com/DataDog/sketches-go/ddsketch/mapping"
	"github.com/DataDog/sketches-go/ddsketch/store"
)

// RelativeAccuracy is the sketches' guarantee: a quantile read from a
// sketch is within this relative distance of the exact value of the same
// rank over the same samples. Half of the 1% asked of /stats, so that the
// guarantee holds with room to spare after float rounding.
const RelativeAccuracy = 0.005

// valueMapping is shared by every sketch: sketches merge only with the
// same mapping. The cubically interpolated mapping needs no logarithm
// per value.
var valueMapping = func() mapping.IndexMapping {
	m, err := mapping.NewCubicallyInterpolatedMapping(RelativeAccuracy)
	if err != nil {
		panic(err)
	}
	return m
}()

// dist is one measure's distribution: a DDSketch for quantiles, and the
// exact count, sum and maximum beside it. Most of a group's aggs hold
// nothing (a quiet group's rings, a measure a dialect never gives), so a
// dist is one pointer, nil while empty: its state is taken from distPool
// at the first value and given back when cleared. The sketch keeps its
// bins in pages of 32 allocated as values reach them, with lone values in
// a small buffer (sketches-go's BufferedPaginatedStore): a sketch of a few
// values is a few hundred bytes, where a dense store took 512 at its
// first. Values are measured durations in milliseconds, from 1 ns to
// hours: about 3,300 bins at most, so no collapsing is needed to bound it.
// Values are clamped at 0, so the negative values' store stays empty: a
// dense one, which allocates nothing until written.
type dist struct{ s *distState }

type distState struct {
	sk       *ddsketch.DDSketch
	n        int64
	sum, max float64
}

func newDist() dist { return dist{} }

// distPool holds cleared states (with their sketches' pages) for the next
// dist that takes a value: a busy group's slots close every 10 s and open
// again at once, so recording allocates nothing once warm.
var distPool = sync.Pool{New: func() any {
	return &distState{sk: ddsketch.NewDDSketch(valueMapping, store.NewBufferedPaginatedStore(), store.NewDenseStore())}
}}

// state returns d's state, taking one when d has none.
func (d *dist) state() *distState {
	if d.s == nil {
		d.s = distPool.Get().(*distState)
	}
	return d.s
}

// count, total and maximum are d's exact count, sum and maximum.
func (d *dist) count() int64 {
	if d.s == nil {
		return 0
	}
	return d.s.n
}

func (d *dist) total() float64 {
	if d.s == nil {
		return 0
	}
	return d.s.sum
}

func (d *dist) maximum() float64 {
	if d.s == nil {
		return 0
	}
	return d.s.max
}

// add records v (milliseconds; negative values are clamped to 0).
func (d *dist) add(v float64) {
	if v < 0 {
		v = 0
	}
	s := d.state()
	if s.sk.Add(v) != nil {
		return // beyond what the mapping indexes (~1e300): not a latency
	}
	s.n++
	s.sum += v
	if v > s.max {
		s.max = v
	}
}

// addAll records every duration of ds.
func (d *dist) addAll(ds []time.Duration) {
	for _, v := range ds {
		d.add(ms(v))
	}
}

func (d *dist) merge(o *dist) {
	if o.count() == 0 {
		return
	}
	s := d.state()
	_ = s.sk.MergeWith(o.s.sk)
	s.n += o.s.n
	s.sum += o.s.sum
	s.max = max(s.max, o.s.max)
}

// mergeSketch adds a sketch of n values summing to sum, the largest maxv.
func (d *dist) mergeSketch(sk *ddsketch.DDSketch, n int64, sum, maxv float64) {
	s := d.state()
	_ = s.sk.MergeWith(sk)
	s.n += n
	s.sum += sum
	s.max = max(s.max, maxv)
}

// encode appends d's sketch to b (nothing when empty).
func (d *dist) encode(b *[]byte) {
	if d.count() > 0 {
		d.s.sk.Encode(b, true)
	}
}

// forEach calls f with each bin's representative value and count.
func (d *dist) forEach(f func(v, n float64) bool) {
	if d.s != nil {
		d.s.sk.ForEach(f)
	}
}

func (d *dist) clear() {
	if d.s != nil {
		d.s.sk.Clear()
		d.s.n, d.s.sum, d.s.max = 0, 0, 0
		distPool.Put(d.s)
		d.s = nil
	}
}

// quantile returns the value at quantile q (0…1), 0 when empty.
func (d *dist) quantile(q float64) float64 {
	if d.count() == 0 {
		return 0
	}
	v, err := d.s.sk.GetValueAtQuantile(q)
	if err != nil {
		return 0
	}
	// The sketch answers with its bin's representative value, which can
	// lie past the exact maximum by up to the relative accuracy.
	return min(v, d.s.max)
}

func (d *dist) mean() float64 {
	if d.count() == 0 {
		return 0
	}
	return d.s.sum / float64(d.s.n)
}
