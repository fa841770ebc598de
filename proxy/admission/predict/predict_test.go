package predict

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/admission/predict/predictsim"
)

// fakeClock is the model's clock, moved by the test.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// feed observes the requests that completed up to until, in order.
func feed(m *Model, c *fakeClock, reqs []predictsim.Request, from *int, until time.Duration, zero time.Time) {
	for ; *from < len(reqs) && reqs[*from].At <= until; *from++ {
		r := reqs[*from]
		c.t = zero.Add(r.At)
		m.Observe(r.K, r.In, r.TTFT, r.TPOT, -1)
	}
	c.t = zero.Add(until)
}

// truth is the simulation's mean TTFT at in-flight level k for requests of
// about in tokens, from the requests completed in [from, to).
func truth(reqs []predictsim.Request, k int, from, to time.Duration, perTok time.Duration, in int) (float64, int) {
	var sum float64
	n := 0
	for _, r := range reqs {
		if r.K == k && r.At >= from && r.At < to {
			// Brought to the reference input size by the true per-token cost.
			sum += ms(r.TTFT) + ms(perTok)*float64(in-r.In)
			n++
		}
	}
	if n == 0 {
		return 0, 0
	}
	return sum / float64(n), n
}

// Requests all of one input size teach no cost per input token, whatever
// the rounding of the running means leaves in the regression's sums:
// a request of another size is predicted as they lived, at every level,
// over clocks stepping from 1 µs to 2 ms between observations.
func TestOneInputSizeTeachesNoTokenCost(t *testing.T) {
	zero := time.Unix(1_700_000_000, 0)
	for step := time.Microsecond; step <= 2*time.Millisecond; step += 7 * time.Microsecond {
		c := &fakeClock{t: zero}
		m := New(c.now)
		for range 5 {
			for k := range 6 {
				c.t = c.t.Add(step)
				m.Observe(k, 10, time.Duration(100+400*k)*time.Millisecond, 10*time.Millisecond, -1)
			}
		}
		for k := range 3 {
			same, _, _ := m.Predict(k, 10)
			other, _, ok := m.Predict(k, 23)
			if !ok || (other-same).Abs() > time.Millisecond {
				t.Fatalf("step %v, level %d: %v at 23 tokens, %v at 10 (known %v); want the same", step, k, other, same, ok)
			}
		}
	}
}

// On a server of 8 slots under bursts of 1.5 times its capacity (its queue
// builds to fifty and drains), the model's TTFT at the levels it saw ten
// times, for a request of 1,000 tokens, is within 10% of the simulation's
// own mean there at the median level; where requests queue (two levels
// past the batch's 8), within 35% at every level; below, never as high as
// the lowest threshold that sheds (60% of a 300 ms objective: no shed
// while the batch has room). The cost per input token it learns is
// within 30% of the truth (0.05 ms); its limit for a 300 ms TTFT is the
// level where the truth crosses 300 ms, to within two levels.
func TestModelLearnsTheCurve(t *testing.T) {
	b := predictsim.New(1)
	capacity := b.Capacity()
	end := 60 * time.Second
	reqs := b.Run(end, predictsim.Bursts(capacity, 1.5, 0.3))
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	zero := c.t
	m := New(c.now)
	i := 0
	feed(m, c, reqs, &i, end+time.Minute, zero)
	c.t = zero.Add(reqs[len(reqs)-1].At) // nothing stale yet

	if pt := m.perToken(); math.Abs(pt-0.05)/0.05 > 0.3 {
		t.Errorf("learned %.4f ms per input token, the truth 0.05", pt)
	}
	checked, crossing := 0, -1
	var errs []float64
	for k := 0; k < 40; k++ {
		want, n := truth(reqs, k, 0, end+time.Minute, b.PerToken, 1000)
		if n < 10 {
			continue
		}
		got, _, ok := m.Predict(k, 1000)
		if !ok {
			t.Fatalf("level %d: no prediction", k)
		}
		e := math.Abs(ms(got)-want) / want
		errs = append(errs, e)
		if k >= 10 && e > 0.35 || k < 8 && ms(got) >= 180 {
			t.Errorf("level %d: predicted %.1f ms, the simulation's mean %.1f (%d requests)", k, ms(got), want, n)
		}
		if want <= 300 {
			crossing = k
		}
		checked++
	}
	if checked < 10 {
		t.Fatalf("only %d levels had 10 requests", checked)
	}
	slices.Sort(errs)
	if med := errs[len(errs)/2]; med > 0.1 {
		t.Errorf("the median level's error %.1f%%, want at most 10%%", 100*med)
	}
	limit, ok := m.Limit(1000, 300*time.Millisecond, 0)
	if !ok || limit < crossing-2 || limit > crossing+2 {
		t.Errorf("limit %d for a 300 ms TTFT, the truth crosses it at level %d", limit, crossing)
	}
	t.Logf("capacity %.1f/s, %d requests, levels checked %d, per token %.4f ms, limit %d (truth %d)", capacity, len(reqs), checked, m.perToken(), limit, crossing)
}

// A backend that slows to half its speed for 20 s, then recovers, under
// bursts of 0.8 times its normal capacity (1.6 times its slowed one):
// while slow, the model's limit for a 300 ms TTFT falls to where the
// slowed truth crosses it (within two levels), and its TTFT there is the
// slowed truth's within 50% (a level's figure is a few seconds' requests); 25 s
// after the recovery both are back to the normal truth,
// the slow levels' figures aged out.
func TestModelFollowsASlowdownAndRecovery(t *testing.T) {
	b := predictsim.New(2)
	b.Slow = func(t time.Duration) float64 {
		if t >= 30*time.Second && t < 50*time.Second {
			return 2
		}
		return 1
	}
	capacity := b.Capacity()
	end := 75 * time.Second
	reqs := b.Run(end, predictsim.Bursts(capacity, 0.8, 0.1))
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	zero := c.t
	m := New(c.now)
	i := 0
	// The truth, as queueing has it: a request's prefill while the batch
	// has room, then a slot's turn (the service time over 8 slots) per
	// request ahead of it; everything doubled while slow.
	prefill := ms(b.Base) + 1000*ms(b.PerToken)
	turn := (ms(b.Base) + 1050*ms(b.PerToken) + float64(b.Out-1)*ms(b.Gap)*1.7) / 8
	want := func(k int, slow float64) float64 { return slow * (prefill + float64(max(0, k-7))*turn) }
	crossing := func(slow float64) int { return 7 + int((300-slow*prefill)/(slow*turn)) }
	look := func(at time.Duration, slow float64) {
		feed(m, c, reqs, &i, at, zero)
		k := crossing(slow)
		p, _, ok := m.Predict(k, 1000)
		limit, _ := m.Limit(1000, 300*time.Millisecond, 0)
		if !ok {
			t.Fatalf("at %v: no prediction", at)
		}
		t.Logf("at %v: level %d predicted %.1f ms (truth %.1f), limit %d (truth %d)", at, k, ms(p), want(k, slow), limit, k)
		if math.Abs(ms(p)-want(k, slow))/want(k, slow) > 0.5 || limit < k-2 || limit > k+2 {
			t.Errorf("at %v: level %d predicted %.1f ms (truth %.1f), limit %d (truth %d)", at, k, ms(p), want(k, slow), limit, k)
		}
	}
	look(49*time.Second, 2)
	look(75*time.Second, 1)
}

// Nothing measured, or nothing measured in the last Stale: no prediction,
// so nothing is decided on a guess.
func TestModelSaysWhenItKnowsNothing(t *testing.T) {
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	m := New(c.now)
	if _, _, ok := m.Predict(3, 100); ok {
		t.Fatal("a prediction with nothing measured")
	}
	for range 5 {
		m.Observe(2, 100, 50*time.Millisecond, 10*time.Millisecond, -1)
	}
	if ttft, tpot, ok := m.Predict(2, 100); !ok || ttft != 50*time.Millisecond || tpot != 10*time.Millisecond {
		t.Fatalf("after five alike: %v %v %v", ttft, tpot, ok)
	}
	c.t = c.t.Add(Stale + time.Second)
	if _, _, ok := m.Predict(2, 100); ok {
		t.Fatal("a prediction from figures older than Stale")
	}
}

// The calibration reports how far predictions were from what requests
// lived: a model told 120 ms before requests that took 100 reads +20%.
func TestCalibration(t *testing.T) {
	m := New(nil)
	for range 50 {
		m.Observe(1, 100, 100*time.Millisecond, -1, 120*time.Millisecond)
	}
	bias, absErr, n := m.Calibration()
	if n != 50 || math.Abs(bias-0.2) > 0.01 || math.Abs(absErr-0.2) > 0.01 {
		t.Fatalf("bias %.3f, error %.3f over %d", bias, absErr, n)
	}
}

// The knee search reads each knee's fit off running sums; its error is
// the weighted squared error of the fitted curve, computed level by level,
// for any figures (here random ones over 60 levels, some unseen).
func TestKneeFitErrorIsTheCurves(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	for trial := range 50 {
		n := 5 + rng.IntN(55)
		w, y := make([]float64, n), make([]float64, n)
		var all sums
		for i := range n {
			if rng.IntN(4) > 0 {
				w[i], y[i] = rng.Float64()*5, 20+float64(i)*rng.Float64()*40+rng.NormFloat64()*10
			}
			all.add(w[i], float64(i), y[i])
		}
		var left sums
		for c := range n {
			left.add(w[c], float64(c), y[c])
			f, e := fitKnee(&left, &all, float64(c))
			if !f.ok {
				continue
			}
			direct := 0.0
			for i := range n {
				got, _ := f.at(float64(i))
				direct += w[i] * (got - y[i]) * (got - y[i])
			}
			if math.Abs(e-direct) > 1e-6*max(direct, 1) {
				t.Fatalf("trial %d, knee %d: error %g from the sums, %g level by level", trial, c, e, direct)
			}
		}
	}
}

// BenchmarkPredict is a prediction with the curve fitted again (a request
// measured since the last), with 1,024 levels seen: what a route that
// sheds pays per request at the most, its model deep in a long queue.
func BenchmarkPredict(b *testing.B) {
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	m := New(c.now)
	for k := range MaxLevel + 1 {
		m.Observe(k, 500, time.Duration(40+k*30)*time.Millisecond, 12*time.Millisecond, -1)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		c.t = c.t.Add(refitEvery)
		m.Observe(i%MaxLevel, 500, time.Duration(40+(i%MaxLevel)*30)*time.Millisecond, 12*time.Millisecond, -1)
		m.Predict(i%64, 700)
	}
}

// oneSlot is the end-to-end overload test's server: one request served at
// a time, 40 ms of prefill, 5 tokens 5 ms apart (a turn of 60 ms).
func oneSlot(seed uint64) *predictsim.Backend {
	return &predictsim.Backend{Slots: 1, Base: 40 * time.Millisecond, Gap: 5 * time.Millisecond, Out: 5,
		InLow: 21, InHigh: 21, Rng: rand.New(rand.NewPCG(seed, 5))}
}

// closedLoop sends n rounds from each of clients that send their next
// request 1 ms after their last completes, from at, and returns the
// requests in the order they completed and when the last completed.
func closedLoop(b *predictsim.Backend, at time.Duration, clients, n int) ([]predictsim.Request, time.Duration) {
	next := make([]time.Duration, clients)
	left := make([]int, clients)
	for i := range next {
		next[i], left[i] = at+time.Duration(i)*time.Millisecond, n
	}
	var out []predictsim.Request
	for {
		c := -1
		for i := range next {
			if left[i] > 0 && (c < 0 || next[i] < next[c]) {
				c = i
			}
		}
		if c < 0 {
			break
		}
		r := b.Arrive(next[c], 21)
		out = append(out, r)
		next[c], left[c] = r.At+time.Millisecond, left[c]-1
		at = max(at, r.At)
	}
	slices.SortFunc(out, func(x, y predictsim.Request) int { return int(x.At - y.At) })
	return out, at
}

// On a server of one slot, taught as the end-to-end overload test teaches
// it (one client, then two; then two again while the gate refuses the
// rest, the backend never holding more than two), the limit for a
// standard request under a 150 ms TTFT objective is the level where the
// truth crosses its threshold, to within one level, for every one of 300
// seeds, when the gateway counted one of the held requests one too many
// (a request the backend had just finished, not yet counted out). The
// truth is the simulation's own mean TTFT per level under bursts of 1.5
// times its capacity. That one figure was all the model had at level 2,
// and a curve let bend flat past its knee there put the limit at 4 to 61.
func TestAFigureCountedHighDoesNotFlattenTheCurve(t *testing.T) {
	sim := oneSlot(1)
	reqs := sim.Run(120*time.Second, predictsim.Bursts(sim.Capacity(), 1.5, 0.5))
	mean := func(k int) float64 { v, _ := truth(reqs, k, 0, time.Hour, 0, 21); return v }
	idle := mean(0)
	threshold := idle + 0.85*(150-idle) // shed's standard share of the budget
	crossing := -1
	for k := 0; mean(k) > 0 && mean(k) <= threshold; k++ {
		crossing = k
	}
	t.Logf("truth: %.1f %.1f %.1f %.1f ms at levels 0-3; threshold %.1f ms, crossed past level %d", mean(0), mean(1), mean(2), mean(3), threshold, crossing)
	if crossing < 1 {
		t.Fatalf("the truth crosses at level %d", crossing)
	}
	zero := time.Unix(1_800_000_000, 0)
	worst := 0
	for seed := range uint64(300) {
		b := oneSlot(seed)
		rng := rand.New(rand.NewPCG(seed, 6))
		c := &fakeClock{t: zero}
		m := New(c.now)
		one, at := closedLoop(b, 0, 1, 10)
		two, at := closedLoop(b, at+time.Millisecond, 2, 10)
		held, _ := closedLoop(b, at+time.Millisecond, 2, 25)
		var lag *predictsim.Request
		for lag == nil || lag.K != 1 {
			lag = &held[rng.IntN(len(held))]
		}
		lag.K++
		for _, r := range slices.Concat(one, two, held) {
			c.t = zero.Add(r.At)
			m.Observe(r.K, r.In, r.TTFT, r.TPOT, -1)
		}
		idleNow, _, _ := m.Predict(0, -1)
		limit, ok := m.Limit(-1, fromMS(ms(idleNow)+0.85*(150-ms(idleNow))), 0)
		if !ok || limit < crossing-1 || limit > crossing+1 {
			t.Errorf("seed %d: limit %d (known %v), the truth crosses past level %d; level 2's figure %.1f ms", seed, limit, ok, crossing, ms(lag.TTFT))
		}
		worst = max(worst, limit-crossing, crossing-limit)
	}
	t.Logf("the limit at most %d levels from the truth's", worst)
}

// First tokens teach the model as they come: three of them, at levels 0,
// 1 and 3, and the model predicts, knows level 3 as the highest measured,
// and counts them in the rate the upstream takes requests in, before any
// request has completed; a completion counts in its completion rate.
func TestFirstTokensTeachBeforeCompletions(t *testing.T) {
	c := &fakeClock{t: time.Unix(1_800_000_000, 0)}
	m := New(c.now)
	if m.Measured() != -1 || m.ServedRate() != 0 {
		t.Fatalf("empty: measured %d, served %.2f", m.Measured(), m.ServedRate())
	}
	m.ObserveFirst(0, 100, 50*time.Millisecond, -1)
	m.ObserveFirst(1, 100, 50*time.Millisecond, -1)
	c.t = c.t.Add(10 * time.Millisecond)
	m.ObserveFirst(3, 100, 60*time.Millisecond, -1)
	if _, _, ok := m.Predict(2, 100); !ok {
		t.Error("three first tokens: nothing predicted")
	}
	if m.Measured() != 3 || m.ServedRate() <= 0 || m.CompletionRate() != 0 {
		t.Errorf("measured %d, served %.2f/s, completed %.2f/s: want 3, some, none", m.Measured(), m.ServedRate(), m.CompletionRate())
	}
	c.t = c.t.Add(Stale + time.Second)
	if m.Measured() != -1 {
		t.Errorf("levels not seen for %v: measured %d, want none", Stale, m.Measured())
	}
	m.ObserveEnd(3, 5*time.Millisecond)
	m.ObserveEnd(3, 5*time.Millisecond)
	if m.CompletionRate() <= 0 {
		t.Error("two completions: no completion rate")
	}
}
