package stats

import (
	"math"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// The measures a group reports (Group.dists gives their JSON names).
const (
	mTTFT = iota
	mTTFA
	mITL
	mTPOT
	mE2E
	mQueue
	mOverhead
	mTTFB
	mClientTTFT
	mClientTTFA
	mClientE2E
	numPublic // the measures above are /stats fields; those below are not
	// mTokensPerS is each request's output tokens per second of its E2E,
	// for comparing throughput per request in flight.
	mTokensPerS = numPublic
	numMeasures = numPublic + 1
)

// How streams read (metrics.Reading): each stream's QoE score, fluidity
// and stall (ms), reported in Group.Reading; after the measures in a
// replica's sketches (SketchGroup.Measures).
const (
	rQoE = iota
	rFluidity
	rStall
	numReading
)

// agg is what a span of time holds for one group: counts and one
// distribution per measure. Aggs of the same group merge.
type agg struct {
	id                                              int64 // the slot, minute or block it holds; -1: none
	count, errors, limited, outTokens, judged, good int64
	refused                                         int64 // answered by tokentap, never sent upstream
	// What the requests cost (micro-dollars, of priced ones) and what the
	// backends said of their prompt caches (requests that reported, those
	// with cached tokens).
	costMicro, priced, cacheReported, cacheHits int64
	missed                                      [metrics.NumSLO]int64
	rd                                          *readAgg // nil: no stream read
	d                                           [numMeasures]dist
}

func newAgg() agg {
	a := agg{id: -1}
	for i := range a.d {
		a.d[i] = newDist()
	}
	return a
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// isError says whether an outcome counts in a group's errors: the
// service's failures (metrics.Outcome.Failure), not a client that left or
// a request refused for its client's own doing.
func isError(o metrics.Outcome) bool { return o.Failure() }

// add records one finished request and its inter-token gaps.
func (a *agg) add(r *metrics.Record, gaps []time.Duration) {
	a.count++
	if isError(r.Outcome) {
		a.errors++
	}
	if r.Outcome == metrics.OutcomeLimited {
		a.limited++
	}
	served := !r.Refused()
	if !served {
		a.refused++
	}
	a.outTokens += int64(r.OutputTokens)
	if r.Cost.USD >= 0 {
		a.priced++
		a.costMicro += int64(math.Round(r.Cost.USD * 1e6))
	}
	if r.CachedTokens >= 0 { // only a usage block says it
		a.cacheReported++
		if r.CachedTokens > 0 {
			a.cacheHits++
		}
	}
	if r.SLOJudged {
		a.judged++
		if r.SLOMisses == 0 {
			a.good++
		}
		for i := range metrics.NumSLO {
			if r.SLOMisses.Has(i) {
				a.missed[i]++
			}
		}
	}
	put := func(m int, d time.Duration) {
		// Only requests sent upstream are timed: a refusal's time is
		// tokentap's answer, never a latency of the route.
		if d >= 0 && served {
			a.d[m].add(ms(d))
		}
	}
	put(mTTFT, r.TTFT)
	put(mTTFA, r.TTFA)
	put(mTPOT, r.TPOT)
	put(mE2E, r.E2E)
	put(mQueue, r.Queue)
	put(mOverhead, r.Overhead)
	put(mTTFB, r.UpstreamTTFB)
	put(mClientTTFT, r.ClientTTFT)
	put(mClientTTFA, r.ClientTTFA)
	put(mClientE2E, r.ClientE2E)
	if r.OutputTokens > 0 && r.E2E > 0 {
		a.d[mTokensPerS].add(float64(r.OutputTokens) / r.E2E.Seconds())
	}
	a.d[mITL].addAll(gaps)
	if r.Reading.Tokens > 0 && served {
		a.reading().add(&r.Reading)
	}
}

// readAgg is what an agg holds of the streams read: how many, those that
// stalled (a wait of a pace or more), their count by the hop that held
// each one's longest wait (metrics.HopNames), and the distributions. Most
// aggs see no stream (a quiet group's rings, a route of embeddings): it is
// made at the first.
type readAgg struct {
	readings, stalled int64
	held              [len(metrics.HopNames)]int64
	d                 [numReading]dist
}

// reading returns a's readAgg, making it.
func (a *agg) reading() *readAgg {
	if a.rd == nil {
		a.rd = &readAgg{}
	}
	return a.rd
}

func (ra *readAgg) add(rd *metrics.Reading) {
	ra.readings++
	if rd.Stalls > 0 {
		ra.stalled++
	}
	ra.held[min(int(rd.HeldBy), len(ra.held)-1)]++
	ra.d[rQoE].add(rd.QoE)
	ra.d[rFluidity].add(rd.Fluidity)
	ra.d[rStall].add(ms(rd.Stall))
}

func (ra *readAgg) merge(o *readAgg) {
	ra.readings += o.readings
	ra.stalled += o.stalled
	for i := range ra.held {
		ra.held[i] += o.held[i]
	}
	for i := range ra.d {
		ra.d[i].merge(&o.d[i])
	}
}

func (a *agg) merge(o *agg) {
	if o.count == 0 {
		return
	}
	a.count += o.count
	a.errors += o.errors
	a.limited += o.limited
	a.refused += o.refused
	a.outTokens += o.outTokens
	a.costMicro += o.costMicro
	a.priced += o.priced
	a.cacheReported += o.cacheReported
	a.cacheHits += o.cacheHits
	a.judged += o.judged
	a.good += o.good
	for i := range a.missed {
		a.missed[i] += o.missed[i]
	}
	if o.rd != nil {
		a.reading().merge(o.rd)
	}
	for i := range a.d {
		a.d[i].merge(&o.d[i])
	}
}

func (a *agg) clear() {
	a.id = -1
	a.count, a.errors, a.limited, a.outTokens, a.judged, a.good, a.refused = 0, 0, 0, 0, 0, 0, 0
	a.costMicro, a.priced, a.cacheReported, a.cacheHits = 0, 0, 0, 0
	a.missed = [metrics.NumSLO]int64{}
	if a.rd != nil {
		for i := range a.rd.d {
			a.rd.d[i].clear()
		}
		a.rd = nil
	}
	for i := range a.d {
		a.d[i].clear()
	}
}

// Slots: the open slot takes every request; when it closes it goes to a
// ring of six (the last minute), and is merged into the minute being
// built, which goes to a ring of five minutes when it closes and is merged
// into the five-minute block being built, which goes to a ring of twelve
// (the last hour). A window is the open slot plus the closed aggs that
// cover it, so every sample is added once and merged at most three times,
// and a group's memory is 27 aggs whatever the traffic.
const (
	slotLen       = 10 * time.Second
	slotsPerMin   = 6
	minsPerBlock  = 5
	slotsPerBlock = slotsPerMin * minsPerBlock
	ringA         = 6  // 10 s slots: the last minute
	ringB         = 5  // minutes: the last five
	ringC         = 12 // five-minute blocks: the last hour
)

// windows is one group's aggs over time.
type windows struct {
	open       agg // the open slot
	a          [ringA]agg
	bCur, cCur agg // the minute and the block being built (closed slots only)
	b          [ringB]agg
	c          [ringC]agg
	all        agg // every closed slot since start
}

func newWindows(slot int64) *windows {
	w := &windows{open: newAgg(), bCur: newAgg(), cCur: newAgg(), all: newAgg()}
	for _, ring := range w.rings() {
		for i := range ring {
			ring[i] = newAgg()
		}
	}
	w.open.id = slot
	return w
}

func (w *windows) rings() [3][]agg { return [3][]agg{w.a[:], w.b[:], w.c[:]} }

// close ends the open slot k and opens k+1.
func (w *windows) close(k int64) {
	w.all.merge(&w.open)
	w.bCur.merge(&w.open)
	push(w.a[:], &w.open, k)
	w.open.id = k + 1
	if (k+1)%slotsPerMin == 0 {
		w.cCur.merge(push(w.b[:], &w.bCur, k/slotsPerMin))
	}
	if (k+1)%slotsPerBlock == 0 {
		push(w.c[:], &w.cCur, k/slotsPerBlock)
	}
}

// push moves the finished cur into ring at id's place, leaves cur empty
// (reusing the displaced agg's memory) and returns the ring's entry.
func push(ring []agg, cur *agg, id int64) *agg {
	e := &ring[mod(id, int64(len(ring)))]
	*e, *cur = *cur, *e
	e.id = id
	cur.clear()
	return e
}

// advance closes slots until slot s is open. A long silence closes the
// empty slots at once.
func (w *windows) advance(s int64) {
	k := w.open.id
	if s <= k {
		return
	}
	w.close(k)
	k++
	if s-k > ringC*slotsPerBlock {
		// Everything in the rings is older than an hour: only all (which
		// every closed slot went into) keeps it.
		for _, ring := range w.rings() {
			for i := range ring {
				ring[i].clear()
			}
		}
		w.bCur.clear()
		w.cCur.clear()
		w.open.id = s
		return
	}
	for ; k < s; k++ {
		w.close(k)
	}
}

// Window names accepted by Query, with their nominal length.
// Windows lists the windows /stats answers, shortest first.
var Windows = []string{"1m", "5m", "15m", "1h", "all"}

var windowLens = map[string]time.Duration{"1m": time.Minute, "5m": 5 * time.Minute, "15m": 15 * time.Minute, "1h": time.Hour, "all": 0}

// collect merges into dst what window covers with slot s open (its first
// slot is windowStart's).
func (w *windows) collect(dst *agg, window string, s int64) {
	dst.merge(&w.open)
	switch window {
	case "1m":
		mergeRing(dst, w.a[:], windowStart(window, s), s)
	case "5m":
		dst.merge(&w.bCur)
		m := s / slotsPerMin
		mergeRing(dst, w.b[:], m-(ringB-1), m)
	case "15m", "1h":
		dst.merge(&w.bCur)
		dst.merge(&w.cCur)
		blk := s / slotsPerBlock
		mergeRing(dst, w.c[:], blk-blocksBack(window), blk)
	default: // all
		dst.merge(&w.all)
	}
}

// blocksBack is how many closed five-minute blocks a window takes.
func blocksBack(window string) int64 {
	if window == "15m" {
		return 2
	}
	return ringC - 1 // 1h: the open block and eleven closed ones
}

// windowStart is the first slot window covers with slot s open (math.
// MinInt64 for all).
func windowStart(window string, s int64) int64 {
	switch window {
	case "1m":
		return s - (ringA - 1)
	case "5m":
		return (s/slotsPerMin - (ringB - 1)) * slotsPerMin
	case "15m", "1h":
		return (s/slotsPerBlock - blocksBack(window)) * slotsPerBlock
	}
	return math.MinInt64
}

// mergeRing merges into dst the aggs of ring that hold ids from from to
// to (excluded); an entry holding an older id is skipped.
func mergeRing(dst *agg, ring []agg, from, to int64) {
	n := int64(len(ring))
	for id := from; id < to; id++ {
		if a := &ring[mod(id, n)]; a.id == id {
			dst.merge(a)
		}
	}
}

// recentAndBefore merges the last one to two minutes (the open slot, the
// minute being built and the last closed minute) into recent, and the
// three minutes before those into before, for trends. It returns the
// first slot of each.
func (w *windows) recentAndBefore(recent, before *agg, s int64) (recentFrom, beforeFrom int64) {
	recent.merge(&w.open)
	recent.merge(&w.bCur)
	m := s / slotsPerMin
	mergeRing(recent, w.b[:], m-1, m)
	mergeRing(before, w.b[:], m-(ringB-1), m-1)
	return (m - 1) * slotsPerMin, (m - (ringB - 1)) * slotsPerMin
}

func mod(a, n int64) int64 { return ((a % n) + n) % n }
