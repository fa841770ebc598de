package shed

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/admission/predict/predictsim"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// The tests run the gate in front of a simulated server whose capacity is
// known (predictsim), on the simulation's clock: a request's fate is known
// when it arrives, and the gate's model hears of it when it completes, as
// tokentap's does.

// objectives is what the simulated requests are judged by: their
// prefill is 25 to 120 ms, a full batch's token gap 10.2 ms.
var objectives = Objectives{TTFT: 300 * time.Millisecond, TPOT: 30 * time.Millisecond}

// result is a simulated run's count, over its measured part.
type result struct {
	sent, good, shed             int
	critSent, critGood, critShed int
	seconds                      float64
	retryAfterMissing            int
	ttfts                        []time.Duration // the served requests'
}

func (r result) goodput() float64 { return float64(r.good) / r.seconds }

func (r result) String() string {
	return fmt.Sprintf("%d sent, %d good (%.1f/s), %d shed, critical %d of %d good (%d shed)", r.sent, r.good, r.goodput(), r.shed, r.critGood, r.critSent, r.critShed)
}

// pending is what the admitted requests have yet to tell the gate: their
// first token, then their end, in time order.
type pending []*event

// event is a request's first token (first) or end, at its time.
type event struct {
	at    time.Duration
	first bool
	req   predictsim.Request
	// predicted is the model's TTFT for it when it was sent (−1: none).
	predicted time.Duration
}

func (h pending) Len() int           { return len(h) }
func (h pending) Less(i, j int) bool { return h[i].at < h[j].at }
func (h pending) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *pending) Push(x any)        { *h = append(*h, x.(*event)) }
func (h *pending) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// scenario is a simulated run: Poisson arrivals at rate(t) a second for
// end, a critical share of them critical, the gate enforcing (and told of
// each refusal, as tokentap tells it) or only predicting; what arrives
// from measureFrom on is counted. The gate hears of each admitted
// request's first token when it comes, and of its end when it ends, as
// tokentap's does, or heard later.
type scenario struct {
	b           *predictsim.Backend
	rate        func(t time.Duration) float64
	end         time.Duration
	measureFrom time.Duration
	critical    float64
	enforce     bool
	seed        uint64
	// heard is how late the gate hears of a first token or an end after
	// it came: on a busy machine, tokentap's wait for a processor.
	heard time.Duration
}

func (s scenario) run() result {
	zero := time.Unix(1_800_000_000, 0)
	clock := zero
	g := New(func() time.Time { return clock })
	rng := rand.New(rand.NewPCG(s.seed, 2))
	var events pending
	var r result
	for t := time.Duration(0); ; {
		t += time.Duration(rng.ExpFloat64() / s.rate(t) * float64(time.Second))
		if t >= s.end {
			break
		}
		for events.Len() > 0 && events[0].at+s.heard <= t {
			e := heap.Pop(&events).(*event)
			clock = zero.Add(e.at + s.heard)
			if e.first {
				g.Model.ObserveFirst(e.req.K, e.req.In, e.req.TTFT, e.predicted)
			} else {
				g.Model.ObserveEnd(e.req.K, e.req.TPOT)
			}
		}
		clock = zero.Add(t)
		p := Standard
		if rng.Float64() < s.critical {
			p = Critical
		}
		in := s.b.Input()
		k := s.b.InSystem(t)
		v := g.Judge(clock, k, in, p, objectives, 0)
		counted := t >= s.measureFrom
		if counted {
			r.sent++
			if p == Critical {
				r.critSent++
			}
		}
		if s.enforce && v.Shed {
			g.Refused(clock)
			if counted {
				r.shed++
				if p == Critical {
					r.critShed++
				}
				if v.RetryAfter < time.Second {
					r.retryAfterMissing++
				}
			}
			continue
		}
		req := s.b.Arrive(t, in)
		predicted := time.Duration(-1)
		if v.Known {
			predicted = v.TTFT
		}
		heap.Push(&events, &event{at: t + req.TTFT, first: true, req: req, predicted: predicted})
		heap.Push(&events, &event{at: req.At, req: req})
		if counted {
			r.ttfts = append(r.ttfts, req.TTFT)
		}
		if counted && req.TTFT <= objectives.TTFT && req.TPOT <= objectives.TPOT {
			r.good++
			if p == Critical {
				r.critGood++
			}
		}
	}
	r.seconds = (s.end - s.measureFrom).Seconds()
	return r
}

// steady is a scenario at a steady load, times the capacity, of the
// standard simulated server, measured after its first 20 s.
func steady(load float64, d time.Duration, critical float64, enforce bool, seed uint64) scenario {
	b := predictsim.New(seed)
	c := b.Capacity()
	return scenario{b: b, rate: func(time.Duration) float64 { return load * c }, end: 20*time.Second + d, measureFrom: 20 * time.Second,
		critical: critical, enforce: enforce, seed: seed}
}

// Across loads from a tenth of the capacity to three times it, over 5
// seeds each: below 0.7 of the capacity at most 2% shed and 90% of what
// is offered good; at twice and three times the capacity, goodput at
// least 0.9 of what 0.85 of it gives without shedding (where forwarding
// everything gives next to nothing); and at no load is goodput with
// shedding worse than without (by more than 2% of the capacity: the
// runs' noise): acting never costs.
func TestSheddingKeepsGoodputAcrossLoads(t *testing.T) {
	wait.Long(t, "minutes of simulated load at nine levels")
	capacity := predictsim.New(0).Capacity()
	const d = 60 * time.Second
	base := 0.0
	for seed := range uint64(5) {
		base += steady(0.85, d, 0, false, 100+seed).run().goodput() / 5
	}
	for _, load := range []float64{0.1, 0.5, 0.7, 0.85, 1, 1.25, 1.5, 2, 3} {
		var off, on result
		for seed := range uint64(5) {
			a, b := steady(load, d, 0, false, 200+seed).run(), steady(load, d, 0, true, 200+seed).run()
			off.sent, off.good, off.seconds = off.sent+a.sent, off.good+a.good, off.seconds+a.seconds
			on.sent, on.good, on.shed, on.seconds = on.sent+b.sent, on.good+b.good, on.shed+b.shed, on.seconds+b.seconds
			on.retryAfterMissing += b.retryAfterMissing
		}
		t.Logf("%.2fx: off %v; on %v", load, off, on)
		if load <= 0.7 && (float64(on.shed) > 0.02*float64(on.sent) || float64(on.good) < 0.9*float64(on.sent)) {
			t.Errorf("%.2fx capacity: %d of %d shed, %d good", load, on.shed, on.sent, on.good)
		}
		if load >= 2 && on.goodput() < 0.9*base {
			t.Errorf("%.2fx capacity: %.1f good/s shedding, want at least 0.9 of %.1f (0.85x, not shedding)", load, on.goodput(), base)
		}
		if on.goodput() < off.goodput()-0.02*capacity {
			t.Errorf("%.2fx capacity: shedding made goodput worse: %.1f/s against %.1f", load, on.goodput(), off.goodput())
		}
		if on.retryAfterMissing > 0 {
			t.Errorf("%.2fx capacity: %d sheds without a Retry-After of a second or more", load, on.retryAfterMissing)
		}
	}
	t.Logf("capacity %.1f/s; 0.85x without shedding %.1f good/s", capacity, base)
}

// With a quarter of the requests critical at twice the capacity (the
// critical ones alone half of it), 95% of the critical ones are good over
// every seed, and goodput as a whole is kept; at three times the capacity
// with half of them critical (1.5 times it: more than the server can
// serve), nothing critical is refused without a first-byte timeout, and
// standard requests are shed first.
func TestCriticalRequestsKeepBeingServed(t *testing.T) {
	wait.Long(t, "minutes of simulated load")
	const d = 60 * time.Second
	for seed := range uint64(5) {
		r := steady(2, d, 0.25, true, 300+seed).run()
		t.Logf("seed %d: %v", seed, r)
		if float64(r.critGood) < 0.95*float64(r.critSent) {
			t.Errorf("seed %d, 2x with 25%% critical: %d of %d critical good", seed, r.critGood, r.critSent)
		}
		if capacity := predictsim.New(0).Capacity(); r.goodput() < 0.8*capacity {
			t.Errorf("seed %d: goodput %.1f/s, capacity %.1f", seed, r.goodput(), capacity)
		}
	}
	r := steady(3, d, 0.5, true, 400).run()
	t.Logf("3x with half critical: %v", r)
	if r.shed < r.sent-r.critSent-int(0.1*float64(r.sent)) {
		t.Errorf("3x with half critical: %d shed of %d standard", r.shed, r.sent-r.critSent)
	}
}

// A server that slows to half its speed for 40 s and recovers, offered
// 1.25 times its normal capacity throughout (2.5 times its slowed one).
// From 15 s into the slowdown, shedding keeps 0.9 of the goodput it keeps
// in front of a server slow from the start (over six seeds; 0.85 in
// each), where forwarding everything keeps under a tenth of it; from 10 s
// after the recovery, within 10% of a run whose server never slowed. Nothing is configured:
// the gate learns the slowed curve and unlearns it.
func TestSheddingFollowsASlowdownAndRecovery(t *testing.T) {
	wait.Long(t, "minutes of simulated load")
	const (
		slowFrom = 30 * time.Second
		slowTo   = 70 * time.Second
	)
	window := func(enforce bool, slow func(time.Duration) float64, seed uint64, from, to time.Duration) result {
		b := predictsim.New(seed)
		c := b.Capacity()
		b.Slow = slow
		return scenario{b: b, rate: func(time.Duration) float64 { return 1.25 * c }, end: to, measureFrom: from, enforce: enforce, seed: seed}.run()
	}
	slowed := func(t time.Duration) float64 {
		if t >= slowFrom && t < slowTo {
			return 2
		}
		return 1
	}
	always := func(time.Duration) float64 { return 2 }
	var sumDuring, sumSlowAll float64
	for seed := range uint64(6) {
		during := window(true, slowed, 500+seed, slowFrom+15*time.Second, slowTo)
		duringOff := window(false, slowed, 500+seed, slowFrom+15*time.Second, slowTo)
		slowAll := window(true, always, 500+seed, slowFrom+15*time.Second, slowTo)
		after := window(true, slowed, 500+seed, slowTo+10*time.Second, slowTo+40*time.Second)
		never := window(true, nil, 500+seed, slowTo+10*time.Second, slowTo+40*time.Second)
		t.Logf("seed %d: slowed, shedding %.1f good/s, not %.1f, slow from the start %.1f; after, %.1f against never slowed %.1f",
			seed, during.goodput(), duringOff.goodput(), slowAll.goodput(), after.goodput(), never.goodput())
		sumDuring, sumSlowAll = sumDuring+during.goodput(), sumSlowAll+slowAll.goodput()
		if during.goodput() < 0.85*slowAll.goodput() || duringOff.goodput() > 0.1*slowAll.goodput() {
			t.Errorf("seed %d: while slowed, %.1f good/s shedding and %.1f not; %.1f slow from the start", seed, during.goodput(), duringOff.goodput(), slowAll.goodput())
		}
		if after.goodput() < 0.9*never.goodput() {
			t.Errorf("seed %d: after the recovery %.1f good/s, never slowed %.1f", seed, after.goodput(), never.goodput())
		}
	}
	if sumDuring < 0.9*sumSlowAll {
		t.Errorf("while slowed, %.2f of the goodput in front of a server slow from the start, want 0.9", sumDuring/sumSlowAll)
	}
}

// The waiting budget: a share of what the objective leaves above an idle
// upstream's figure, and none at all where an idle upstream would miss
// it too (refusing would hasten nothing).
func TestThreshold(t *testing.T) {
	for _, c := range []struct {
		obj, idle time.Duration
		share     float64
		want      time.Duration
	}{
		{300 * time.Millisecond, 100 * time.Millisecond, 0.5, 200 * time.Millisecond},
		{300 * time.Millisecond, 0, 0.85, 255 * time.Millisecond},
		{300 * time.Millisecond, 300 * time.Millisecond, 0.85, 0},
		{300 * time.Millisecond, 400 * time.Millisecond, 0.85, 0},
		{0, 10 * time.Millisecond, 0.85, 0},
		{300 * time.Millisecond, -1, 0.85, 0},
	} {
		if got := threshold(c.obj, c.idle, c.share); got != c.want {
			t.Errorf("threshold(%v, %v, %v) = %v, want %v", c.obj, c.idle, c.share, got, c.want)
		}
	}
}

func TestParsePriority(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Priority
		ok   bool
	}{{"critical", Critical, true}, {"standard", Standard, true}, {"sheddable", Sheddable, true}, {"urgent", Standard, false}, {"", Standard, false}} {
		if p, ok := ParsePriority(c.in); p != c.want || ok != c.ok {
			t.Errorf("ParsePriority(%q) = %v %v", c.in, p, ok)
		}
	}
}

// cold is a scenario from a fresh gate: load times the capacity of the
// standard simulated server, a critical share of it, from the first
// request on, measured from from to end.
func cold(load, critical float64, from, end time.Duration, seed uint64) scenario {
	b := predictsim.New(seed)
	c := b.Capacity()
	return scenario{b: b, rate: func(time.Duration) float64 { return load * c }, end: end, measureFrom: from, critical: critical, enforce: true, seed: seed}
}

// A fresh gate offered three times the capacity at once, a fifth of it
// critical (0.6 of the capacity), keeps 95% of the critical requests good
// from the first second (over six seeds; 90% in each), as it does warm:
// before the model knows the curve past the levels measured, the lower
// priorities climb at most a quarter past them, and they leave the
// critical requests the levels those hold. Before, 85% over 20 s and 24%
// in the first 2 s (a queue of seconds built before the model learned).
func TestCriticalKeptFromAColdStart(t *testing.T) {
	wait.Long(t, "minutes of simulated load")
	var first, all, warm result
	add := func(sum *result, r result) {
		sum.critSent, sum.critGood, sum.critShed = sum.critSent+r.critSent, sum.critGood+r.critGood, sum.critShed+r.critShed
	}
	for seed := range uint64(6) {
		r := cold(3, 0.2, 0, 20*time.Second, 700+seed).run()
		add(&all, r)
		add(&first, cold(3, 0.2, 0, 2*time.Second, 700+seed).run())
		add(&warm, steady(3, 60*time.Second, 0.2, true, 800+seed).run())
		t.Logf("seed %d: %v", seed, r)
		if float64(r.critGood) < 0.9*float64(r.critSent) {
			t.Errorf("seed %d: %d of %d critical good from a cold start", seed, r.critGood, r.critSent)
		}
	}
	for _, c := range []struct {
		name string
		r    result
	}{{"the first 2 s", first}, {"20 s from a cold start", all}, {"warm", warm}} {
		t.Logf("%s: %d of %d critical good, %d shed", c.name, c.r.critGood, c.r.critSent, c.r.critShed)
		if float64(c.r.critGood) < 0.95*float64(c.r.critSent) || c.r.critShed > 0 {
			t.Errorf("%s: %d of %d critical good (%d shed), want 95%% and none shed", c.name, c.r.critGood, c.r.critSent, c.r.critShed)
		}
	}
}

// From a cold start below the capacity, with and without critical
// requests, next to nothing is shed: at most 1% at 0.7 of the capacity,
// none at 0.5 (six seeds of 20 s each).
func TestNoShedBelowCapacityFromAColdStart(t *testing.T) {
	for _, load := range []float64{0.3, 0.5, 0.7} {
		for _, critical := range []float64{0, 0.2} {
			var sum result
			for seed := range uint64(6) {
				r := cold(load, critical, 0, 20*time.Second, 900+seed).run()
				sum.sent, sum.shed, sum.good = sum.sent+r.sent, sum.shed+r.shed, sum.good+r.good
			}
			t.Logf("%.1fx, %.0f%% critical: %d sent, %d shed, %d good", load, 100*critical, sum.sent, sum.shed, sum.good)
			if load <= 0.5 && sum.shed > 0 || float64(sum.shed) > 0.01*float64(sum.sent) {
				t.Errorf("%.1fx capacity from a cold start, %.0f%% critical: %d of %d shed", load, 100*critical, sum.shed, sum.sent)
			}
		}
	}
}

// On a busy machine tokentap hears of first tokens and ends late (it waits
// for a processor), and the arrivals it judges run ahead of the first
// tokens it has heard of while the load rises. From a cold start at half
// to 0.7 of the capacity, a fifth of it critical, with every first token
// and end heard 0.2 to 0.8 s late: at most 0.5% shed after the first 3 s
// (20 seeds of 11 s; as the busy machine's test over loopback measures).
// Read as arrivals against 1.2 times the first tokens heard, the lag
// alone stood for a queue: 0.9% shed at 0.6x heard 0.4 s late, 2.5% at
// 0.7x heard 0.8 s late.
func TestNoShedBelowCapacityWhenHeardLate(t *testing.T) {
	for _, heard := range []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond} {
		for _, load := range []float64{0.5, 0.6, 0.7} {
			var sum result
			for seed := range uint64(20) {
				s := cold(load, 0.2, 3*time.Second, 11*time.Second, 900+seed)
				s.heard = heard
				r := s.run()
				sum.sent, sum.shed, sum.good = sum.sent+r.sent, sum.shed+r.shed, sum.good+r.good
			}
			t.Logf("heard %v late, %.1fx: %d sent, %d shed, %d good", heard, load, sum.sent, sum.shed, sum.good)
			if float64(sum.shed) > 0.005*float64(sum.sent) {
				t.Errorf("heard %v late, %.1fx from a cold start: %d of %d shed", heard, load, sum.shed, sum.sent)
			}
		}
	}
}
