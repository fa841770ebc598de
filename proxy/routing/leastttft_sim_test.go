package routing

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/admission/predict/predictsim"
	"github.com/tokentap/tokentap/proxy/upstream"
)

// The balance tests below run a route's real choice (leastTTFT, or pick
// for least_inflight) in front of simulated servers whose truth is known
// (predictsim), on the simulation's clock: each upstream's model hears of
// a request when it completes, as tokentap's does, so minutes of traffic
// take milliseconds and the figures are the same on any machine. The
// wall-clock tests in proxy's leastttft_test.go check the same wiring end to end.

// simRoute is a route of simulated upstreams on a clock of its own:
// zero, and elapsed since (the backends' time).
type simRoute struct {
	r        *Set
	backends map[*Member]*predictsim.Backend
	zero     time.Time
	elapsed  time.Duration
	clock    time.Time
	waiting  simPending // sent, not yet completed
}

// newSimRoute is a route balanced by balance in front of backends, named
// by names.
func newSimRoute(t *testing.T, balance string, names []string, backends []*predictsim.Backend) *simRoute {
	t.Helper()
	s := &simRoute{backends: map[*Member]*predictsim.Backend{}, zero: time.Unix(1_800_000_000, 0)}
	s.clock = s.zero
	var members []*Member
	for i, name := range names {
		up, err := upstream.New("http://127.0.0.1:1", upstream.DefaultTimeouts, func() time.Time { return s.clock }, nil)
		if err != nil {
			t.Fatal(err)
		}
		m := &Member{Name: name, Up: up, Weight: 1}
		members = append(members, m)
		s.backends[m] = backends[i]
	}
	s.r = NewSet(members, Options{Balance: balance}, s.zero)
	return s
}

// simSent is a request sent on a simulated route, pending its completion.
type simSent struct {
	predictsim.Request
	m         *Member
	k         int
	predicted time.Duration
}

type simPending []simSent

func (h simPending) Len() int           { return len(h) }
func (h simPending) Less(i, j int) bool { return h[i].At < h[j].At }
func (h simPending) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *simPending) Push(x any)        { *h = append(*h, x.(simSent)) }
func (h *simPending) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// simSplit is what a simulated run got over its measured part.
type simSplit struct {
	sent, good int
	by         map[string]int
	why        [numReasons]int
	ttft       []time.Duration
}

// add counts another run's figures in s.
func (s *simSplit) add(o simSplit) {
	if s.by == nil {
		s.by = map[string]int{}
	}
	s.sent, s.good = s.sent+o.sent, s.good+o.good
	for k, v := range o.by {
		s.by[k] += v
	}
	for i, v := range o.why {
		s.why[i] += v
	}
	s.ttft = append(s.ttft, o.ttft...)
}

// p99 is the 99th percentile of the first tokens.
func (s simSplit) p99() time.Duration {
	slices.Sort(s.ttft)
	return s.ttft[len(s.ttft)*99/100]
}

func (s simSplit) share() float64 { return float64(s.good) / float64(s.sent) }

func (s simSplit) String() string {
	return fmt.Sprintf("%d of %d good (%.1f%%), TTFT p99 %v, split %v, why %v", s.good, s.sent, 100*s.share(), s.p99().Round(time.Millisecond), s.by, s.why)
}

// run offers Poisson arrivals of in input tokens at rate(t) a second for
// d from where the last run ended (t is the backends' time), and counts
// those from measureFrom into the run on against the TTFT objective.
func (s *simRoute) run(rate func(time.Duration) float64, d, measureFrom time.Duration, in int, objective time.Duration, seed uint64) simSplit {
	zero, end := s.zero, s.elapsed+d
	measureFrom += s.elapsed
	rng, rolls := rand.New(rand.NewPCG(seed, 3)), rand.New(rand.NewPCG(seed, 5)) // the same arrivals for every balance
	waiting := &s.waiting
	out := simSplit{by: map[string]int{}}
	for t := s.elapsed; ; {
		t += time.Duration(rng.ExpFloat64() / rate(t) * float64(time.Second))
		if t >= end {
			break
		}
		for waiting.Len() > 0 && (*waiting)[0].At <= t {
			d := heap.Pop(waiting).(simSent)
			s.clock = zero.Add(d.At)
			d.m.Up.Inflight.Add(-1)
			d.m.NoteSlot(d.At - d.Arrived)
			d.m.Up.Gate.Model.Observe(d.k, d.In, d.TTFT, d.TPOT, d.predicted)
		}
		s.clock = zero.Add(t)
		var m *Member
		predicted, why := time.Duration(-1), pickBalance
		if s.r.balance == BalanceLeastTTFT {
			m, predicted, why = s.r.leastTTFT(s.clock, in, rolls.Float64(), objective)
		} else {
			m, _, _ = s.r.pick("", nil)
		}
		k := int(m.Up.Inflight.Add(1) - 1)
		req := s.backends[m].Arrive(t, in)
		heap.Push(waiting, simSent{Request: req, m: m, k: k, predicted: predicted})
		if t >= measureFrom {
			out.sent++
			out.by[m.Name]++
			out.why[why]++
			out.ttft = append(out.ttft, req.TTFT)
			if req.TTFT <= objective {
				out.good++
			}
		}
	}
	s.clock, s.elapsed = zero.Add(end), end
	return out
}

// The simulated servers of the least_ttft tests, as proxy's leastttft_test.go's:
// 4 slots each, 20 tokens 5 ms apart alone; the fast one prefills in 40
// ms, the slow one in 200 ms.
func fastSim(seed uint64) *predictsim.Backend {
	return &predictsim.Backend{Slots: 4, Base: 40 * time.Millisecond, Gap: 5 * time.Millisecond, Out: 20, InLow: 20, InHigh: 20, Rng: rand.New(rand.NewPCG(seed, 4))}
}

func slowSim(seed uint64) *predictsim.Backend {
	b := fastSim(seed)
	b.Base = 200 * time.Millisecond
	return b
}

// TestLeastTTFTGoodputSimulated: the route of TestLeastTTFTGoodput on the
// simulation's clock, five seeds of two minutes at each load from 20% to
// 100% of the two servers' joint capacity: least predicted TTFT gives at
// least 1.2 times the goodput of fewest in flight at 60%, and a lower
// TTFT p99 from 60% on; and, with that pair, a pair the slow one could
// serve in time (a 300 ms objective) and two alike, it is never worse
// than fewest in flight by more than the runs' noise (1% of what is
// sent): acting on the prediction must not cost.
func TestLeastTTFTGoodputSimulated(t *testing.T) {
	for _, c := range []struct {
		name      string
		slow      func(uint64) *predictsim.Backend
		objective time.Duration
		gain      float64 // at 0.6x
	}{
		{"fast and 5x slower prefill, 150 ms", slowSim, 150 * time.Millisecond, 1.2},
		{"fast and 5x slower prefill, 300 ms", slowSim, 300 * time.Millisecond, 1},
		{"two alike, 150 ms", fastSim, 150 * time.Millisecond, 1},
	} {
		joint := fastSim(0).Capacity() + c.slow(0).Capacity()
		for _, load := range []float64{0.2, 0.4, 0.6, 0.8, 0.9} {
			var inflight, ttft simSplit
			for seed := range uint64(5) {
				rate := func(time.Duration) float64 { return load * joint }
				for _, b := range []string{BalanceLeastInflight, BalanceLeastTTFT} {
					s := newSimRoute(t, b, []string{"fast", "slow"}, []*predictsim.Backend{fastSim(seed), c.slow(seed)})
					got := s.run(rate, 140*time.Second, 20*time.Second, 20, c.objective, 100+seed)
					sum := &inflight
					if b == BalanceLeastTTFT {
						sum = &ttft
					}
					sum.add(got)
				}
			}
			t.Logf("%s, %.1fx of %.1f/s: least_inflight %v; least_ttft %v (%.2fx)", c.name, load, joint, inflight, ttft, ttft.share()/inflight.share())
			if c.gain > 1 && load == 0.6 && ttft.share() < c.gain*inflight.share() {
				t.Errorf("%s, %.1fx: least_ttft %.1f%% good, least_inflight %.1f%%: want at least %.1fx",
					c.name, load, 100*ttft.share(), 100*inflight.share(), c.gain)
			}
			if c.gain > 1 && load >= 0.6 && ttft.p99() >= inflight.p99() {
				t.Errorf("%s, %.1fx: least_ttft's TTFT p99 %v, least_inflight's %v: want lower", c.name, load, ttft.p99(), inflight.p99())
			}
			if ttft.share() < inflight.share()-0.01 {
				t.Errorf("%s, %.1fx: least_ttft %.1f%% good, worse than least_inflight's %.1f%%", c.name, load, 100*ttft.share(), 100*inflight.share())
			}
		}
	}
}

// TestLeastTTFTFollowsASlowdownSimulated: the pair at 30% of its joint
// capacity, the fast one slowing fourfold after 40 s (its prefill 160 ms,
// its capacity about 6 a second, less than what is offered): before, the
// fast one takes nearly everything; over the minute after (when neither
// serves a first token within the 150 ms objective, the fast one's 160 ms
// prefill still the sooner while its queue is short), both take a share
// and TTFT p99 stays within 1.2 s, on every seed.
func TestLeastTTFTFollowsASlowdownSimulated(t *testing.T) {
	const objective = 150 * time.Millisecond
	joint := fastSim(0).Capacity() + slowSim(0).Capacity()
	for seed := range uint64(5) {
		fast := fastSim(seed)
		fast.Slow = func(at time.Duration) float64 {
			if at >= 40*time.Second {
				return 4
			}
			return 1
		}
		s := newSimRoute(t, BalanceLeastTTFT, []string{"fast", "slow"}, []*predictsim.Backend{fast, slowSim(seed)})
		rate := func(time.Duration) float64 { return 0.3 * joint }
		before := s.run(rate, 40*time.Second, 20*time.Second, 20, objective, 200+seed)
		after := s.run(rate, 60*time.Second, 0, 20, objective, 300+seed)
		t.Logf("seed %d: before %v; after the slowdown %v", seed, before, after)
		if before.by["fast"] < 10*before.by["slow"] {
			t.Errorf("seed %d: before the slowdown split %v, want the fast upstream to take nearly all", seed, before.by)
		}
		if after.by["slow"] < after.sent/4 || after.by["fast"] < after.sent/4 || after.p99() > 1200*time.Millisecond {
			t.Errorf("seed %d: after the slowdown split %v, TTFT p99 %v: want both to take a quarter at least, p99 within 1.2s", seed, after.by, after.p99())
		}
	}
}
