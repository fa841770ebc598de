package stats

import (
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

// maxBins bounds a sketch's bins, so its memory is constant: at 0.5%
// relative accuracy, 2048 bins span a factor of 10⁸ (1 µs to 100 s in
// one sketch, in milliseconds). Wider data collapses its lowest bins,
// losing accuracy only there.
const maxBins = 2048

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
// exact count, sum and maximum beside it.
type dist struct {
	sk       *ddsketch.DDSketch
	n        int64
	sum, max float64
}

func newDist() dist {
	return dist{sk: ddsketch.NewDDSketch(valueMapping, store.NewCollapsingLowestDenseStore(maxBins), store.NewCollapsingLowestDenseStore(8))}
}

// add records v (milliseconds; negative values are clamped to 0).
func (d *dist) add(v float64) {
	if v < 0 {
		v = 0
	}
	if d.sk.Add(v) != nil {
		return // beyond what the mapping indexes (~1e300): not a latency
	}
	d.n++
	d.sum += v
	if v > d.max {
		d.max = v
	}
}

// addAll records every duration of ds.
func (d *dist) addAll(ds []time.Duration) {
	for _, v := range ds {
		d.add(ms(v))
	}
}

func (d *dist) merge(o *dist) {
	if o.n == 0 {
		return
	}
	_ = d.sk.MergeWith(o.sk)
	d.n += o.n
	d.sum += o.sum
	d.max = max(d.max, o.max)
}

func (d *dist) clear() {
	d.sk.Clear()
	d.n, d.sum, d.max = 0, 0, 0
}

// quantile returns the value at quantile q (0…1), 0 when empty.
func (d *dist) quantile(q float64) float64 {
	if d.n == 0 {
		return 0
	}
	v, err := d.sk.GetValueAtQuantile(q)
	if err != nil {
		return 0
	}
	// The sketch answers with its bin's representative value, which can
	// lie past the exact maximum by up to the relative accuracy.
	return min(v, d.max)
}

func (d *dist) mean() float64 {
	if d.n == 0 {
		return 0
	}
	return d.sum / float64(d.n)
}
