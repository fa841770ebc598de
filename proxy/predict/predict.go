// Package predict learns, per upstream, what a new request would live
// there now: its time to first token and time per output token, from the
// requests the upstream finished and the number it had in flight when each
// started. No capacity is configured: an inference server's first token
// waits little while its batch has room and a slot's turn per request
// ahead once it is full, and the model reads that curve off what it
// measures, level by level, and follows it as the backend slows or
// recovers.
//
//	m := predict.New(time.Now)
//	ttft, tpot, ok := m.Predict(inflight, inputTokens) // before sending
//	m.Observe(inflightAtStart, inputTokens, ttft, tpot) // once measured
//
// A Model is safe for concurrent use.
package predict

import (
	"math"
	"sync"
	"time"
)

// The model's constants.
const (
	// MaxLevel bounds the in-flight levels the model keeps apart; requests
	// started above it count at it.
	MaxLevel = 1024
	// Stale is how long a level's figure is believed without a new
	// request: a backend that recovered while shedding kept requests off
	// the levels that were slow is found out once those figures age.
	Stale = 15 * time.Second
	// tau is the memory of a level's figures: a request's weight halves
	// every 0.7·tau, so that a backend that slowed is followed within
	// seconds however few requests a level sees.
	tau = 5 * time.Second
	// minWeight is the weight of recent requests the model needs before it
	// is believed; maxFitWeight the most one level weighs in the fit.
	minWeight    = 2
	maxFitWeight = 5
	// staleWeight is what a level not seen for Stale weighs in the fit.
	staleWeight = 0.05
)

// level is what the requests started at one in-flight level lived: an
// average of their TTFT (at the reference input size) and of their TPOT,
// in milliseconds, each request weighing exp(−age/tau), and the weights.
type level struct {
	ttft, tpot float64
	w, wTPOT   float64
	at         time.Time // the last request's
}

// add averages x into v of weight w, last updated at, at now.
func decayed(v, w *float64, x float64, at, now time.Time) {
	*w *= math.Exp(-float64(now.Sub(at)) / float64(tau))
	*v = (*v**w + x) / (*w + 1)
	*w++
}

// Model is one upstream's model.
type Model struct {
	now func() time.Time

	mu     sync.Mutex
	levels []level // by in-flight level at start, up to the highest seen
	// The cost of each input token above or below the reference size
	// (inRef): a regression of a request's TTFT, less its level's figure,
	// on its input size's distance from the reference, with forgetting.
	inRef, sxy, sxx float64
	// done is the completions a second (exponential average over ~5 s)
	// and doneAt the last completion: how fast a queue drains.
	done   float64
	doneAt time.Time
	// The prediction's error against what requests then lived: an
	// exponential average of (predicted − actual) / actual and of its
	// absolute value, over the requests it predicted.
	bias, absErr float64
	judged       int
	// The fitted curve (curve), made again at most every refitEvery;
	// seen counts the requests measured, fitSeen those the fit had.
	last          fit
	fitted        bool
	fitAt         time.Time
	seen, fitSeen int
}

// New returns an empty model on the clock now (nil: time.Now).
func New(now func() time.Time) *Model {
	if now == nil {
		now = time.Now
	}
	return &Model{now: now}
}

// Observe adds a finished request that started with k others in flight on
// the upstream, had in input tokens, and lived ttft to its first token and
// tpot per output token after it (negative: not measured, as a request
// that failed before its first token or had one token). predicted is what
// the model said before it was sent (negative: nothing), for its error.
func (m *Model) Observe(k, in int, ttft, tpot, predicted time.Duration) {
	now := m.now()
	k = min(max(k, 0), MaxLevel)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.completed(now)
	if ttft < 0 {
		return
	}
	for len(m.levels) <= k {
		m.levels = append(m.levels, level{})
	}
	l := &m.levels[k]
	y := ms(ttft)
	// The per-token cost, from the request's distance to its level.
	if m.inRef == 0 {
		m.inRef = float64(in)
	}
	x := float64(in) - m.inRef
	if l.w > 0 {
		const forget = 0.999
		m.sxy = forget*m.sxy + x*(y-l.ttft)
		m.sxx = forget*m.sxx + x*x
	}
	m.inRef += 0.01 * (float64(in) - m.inRef)
	decayed(&l.ttft, &l.w, y-m.perToken()*x, l.at, now)
	m.seen++
	if tpot >= 0 {
		decayed(&l.tpot, &l.wTPOT, ms(tpot), l.at, now)
	}
	l.at = now
	if predicted >= 0 && y > 0 {
		e := (ms(predicted) - y) / y
		m.judged++
		a := max(1/float64(m.judged), 0.05)
		m.bias += a * (e - m.bias)
		m.absErr += a * (math.Abs(e) - m.absErr)
	}
}

// completed counts a completion at now in the completion rate. m.mu is
// held.
func (m *Model) completed(now time.Time) {
	if m.doneAt.IsZero() {
		m.doneAt = now
		return
	}
	dt := now.Sub(m.doneAt).Seconds()
	m.doneAt = now
	// An event rate as an exponential average over tau: each event adds
	// 1/tau, and the rate decays by exp(−dt/tau) in between.
	const tau = 5.0
	m.done = m.done*math.Exp(-dt/tau) + 1/tau
}

// perToken is the TTFT cost of one input token, in ms (never negative).
// m.mu is held.
func (m *Model) perToken() float64 {
	if m.sxx <= 0 {
		return 0
	}
	return max(m.sxy/m.sxx, 0)
}

// Predict returns the TTFT and TPOT a request of in input tokens would
// live if sent now with k requests in flight on the upstream; ok is false
// while the model believes nothing (less than minWeight of requests
// measured recently), and then nothing should be decided on it.
func (m *Model) Predict(k, in int) (ttft, tpot time.Duration, ok bool) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.curve(now)
	if !f.ok {
		return -1, -1, false
	}
	t, p := f.at(float64(min(max(k, 0), MaxLevel)))
	t += m.perToken() * (float64(in) - m.inRef)
	return fromMS(max(t, 0)), fromMS(p), true
}

// fit is the curve read off the levels: TTFT = a + b1·min(k, c) +
// b2·max(0, k − c), a knee at c where the batch is full and each request
// ahead adds its turn; TPOT = pa + pb·min(k, c), a batch that decodes no
// slower once full (pa < 0: no TPOT measured).
type fit struct {
	a, b1, b2, c float64
	pa, pb       float64
	ok           bool
}

func (f *fit) at(k float64) (ttft, tpot float64) {
	ttft = f.a + f.b1*min(k, f.c) + f.b2*max(0, k-f.c)
	tpot = -1
	if f.pa >= 0 {
		tpot = f.pa + f.pb*min(k, f.c)
	}
	return ttft, tpot
}

// refitEvery bounds how often the curve is fitted again (Predict runs on
// every request of a route that sheds).
const refitEvery = 100 * time.Millisecond

// curve is the fit of the levels at now, made again when refitEvery has
// passed since the last and requests were measured meanwhile. m.mu is
// held.
func (m *Model) curve(now time.Time) *fit {
	if m.fitted && now.Sub(m.fitAt) < refitEvery && m.seen == m.fitSeen {
		return &m.last
	}
	m.last, m.fitAt, m.fitSeen, m.fitted = m.fitLevels(now), now, m.seen, true
	return &m.last
}

// fitLevels fits the curve to the levels' figures, each weighing its
// requests' weight now (decayed since the last; believed only with
// minWeight of them within Stale): every knee c from 0 to
// the highest level seen is tried, the one that leaves the least weighted
// squared error kept; slopes are never negative (one more request in
// flight never makes the first token come sooner).
func (m *Model) fitLevels(now time.Time) fit {
	n := len(m.levels)
	w := make([]float64, n)
	total := 0.0
	for i := range m.levels {
		l := &m.levels[i]
		switch {
		case l.w == 0:
		case now.Sub(l.at) <= Stale:
			// A level weighs its recent requests, up to maxFitWeight: the
			// levels a queue passes through often do not drown the shape
			// of those it passes rarely (the knee).
			w[i] = min(max(l.w*math.Exp(-float64(now.Sub(l.at))/float64(tau)), staleWeight), maxFitWeight)
			total += w[i]
		default:
			// Not seen lately: still the best word on its level where
			// nothing fresher is (the idle levels after a long queue), and
			// next to nothing where fresh levels are.
			w[i] = staleWeight
		}
	}
	if total < minWeight {
		return fit{}
	}
	best, bestErr := fit{ok: true}, math.Inf(1)
	for c := 0; c < n; c++ {
		f, e := m.fitKnee(w, float64(c))
		if e < bestErr {
			best, bestErr = f, e
		}
	}
	// The TPOT: its level, at the same knee.
	best.pa, best.pb = -1, 0
	var sw, sx, sy, sxx, sxy float64
	for i := range m.levels {
		l := &m.levels[i]
		if w[i] == 0 || l.wTPOT == 0 {
			continue
		}
		x := min(float64(i), best.c)
		sw, sx, sy, sxx, sxy = sw+w[i], sx+w[i]*x, sy+w[i]*l.tpot, sxx+w[i]*x*x, sxy+w[i]*x*l.tpot
	}
	if sw > 0 {
		best.pa, best.pb = sy/sw, 0
		if d := sw*sxx - sx*sx; d > 1e-9 {
			if b := (sw*sxy - sx*sy) / d; b > 0 {
				best.pb, best.pa = b, (sy-b*sx)/sw
			}
		}
	}
	return best
}

// fitKnee is the weighted least-squares fit of the TTFT curve with its knee
// at c, and its weighted squared error.
func (m *Model) fitKnee(w []float64, c float64) (fit, float64) {
	// Normal equations of y = a + b1·u + b2·v, u = min(k, c), v = max(0, k − c).
	var s [3][3]float64
	var r [3]float64
	for i := range m.levels {
		if w[i] == 0 {
			continue
		}
		k := float64(i)
		x := [3]float64{1, min(k, c), max(0, k-c)}
		y := m.levels[i].ttft
		for p := range 3 {
			for q := range 3 {
				s[p][q] += w[i] * x[p] * x[q]
			}
			r[p] += w[i] * x[p] * y
		}
	}
	// Solve with the slopes kept apart when there is nothing on a side of
	// the knee, and never negative.
	f := fit{c: c, ok: true}
	use := [3]bool{true, s[1][1] > 1e-9, s[2][2] > 1e-9}
	for range 4 {
		coef, good := solve(s, r, use)
		switch {
		case !good && use[2]:
			use[2] = false // too few levels for a knee: one line
			continue
		case !good && use[1]:
			use[1] = false // one level: its figure
			continue
		case !good:
			return fit{}, math.Inf(1)
		}
		f.a, f.b1, f.b2 = coef[0], coef[1], coef[2]
		if f.b1 >= 0 && f.b2 >= 0 && f.a >= 0 {
			break
		}
		if f.b1 < 0 {
			use[1], f.b1 = false, 0
		}
		if f.b2 < 0 {
			use[2], f.b2 = false, 0
		}
		if f.a < 0 && f.b1 >= 0 && f.b2 >= 0 {
			use[0], f.a = false, 0 // no time below nothing: through 0
		}
	}
	if !use[2] {
		// Nothing measured past the knee, or a slope that fell: one line
		// goes on past it.
		f.b2 = f.b1
	}
	e := 0.0
	for i := range m.levels {
		if w[i] > 0 {
			got, _ := f.at(float64(i))
			d := got - m.levels[i].ttft
			e += w[i] * d * d
		}
	}
	return f, e
}

// solve solves the normal equations s·x = r for the coefficients in use
// (the others 0), by Gaussian elimination.
func solve(s [3][3]float64, r [3]float64, use [3]bool) ([3]float64, bool) {
	var idx []int
	for i, u := range use {
		if u {
			idx = append(idx, i)
		}
	}
	n := len(idx)
	a := make([][]float64, n)
	for i, p := range idx {
		a[i] = make([]float64, n+1)
		for j, q := range idx {
			a[i][j] = s[p][q]
		}
		a[i][n] = r[p]
	}
	for col := range n {
		piv := col
		for row := col + 1; row < n; row++ {
			if math.Abs(a[row][col]) > math.Abs(a[piv][col]) {
				piv = row
			}
		}
		if math.Abs(a[piv][col]) < 1e-12 {
			return [3]float64{}, false
		}
		a[col], a[piv] = a[piv], a[col]
		for row := range n {
			if row != col {
				f := a[row][col] / a[col][col]
				for j := col; j <= n; j++ {
					a[row][j] -= f * a[col][j]
				}
			}
		}
	}
	var out [3]float64
	for i, p := range idx {
		out[p] = a[i][n] / a[i][i]
	}
	return out, true
}

// Limit returns the most requests in flight at which a request of in
// input tokens is predicted to meet ttft and tpot (0 or less: no
// objective), and ok false while nothing is believed; -1 when even an
// idle upstream would miss them. It looks at most 64 levels past the
// highest seen.
func (m *Model) Limit(in int, ttft, tpot time.Duration) (limit int, ok bool) {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.curve(now)
	if !f.ok {
		return 0, false
	}
	top := min(len(m.levels)+64, MaxLevel)
	limit = -1
	for k := 0; k <= top; k++ {
		t, p := f.at(float64(k))
		t += m.perToken() * (float64(in) - m.inRef)
		if ttft > 0 && t > ms(ttft) || tpot > 0 && p > ms(tpot) {
			break
		}
		limit = k
	}
	return limit, true
}

// DrainTime is how long until k−limit requests in flight have finished
// at the upstream's completion rate: when a request refused now could be
// served (at least a second).
func (m *Model) DrainTime(k, limit int) time.Duration {
	m.mu.Lock()
	rate := m.done * math.Exp(-m.now().Sub(m.doneAt).Seconds()/5)
	m.mu.Unlock()
	ahead := float64(k - limit + 1)
	if rate <= 0 || ahead <= 0 {
		return time.Second
	}
	return max(time.Second, time.Duration(ahead/rate*float64(time.Second)))
}

// Calibration is how well the model predicted: the mean relative error
// of its TTFT predictions (positive: it predicts too long) and the mean
// absolute relative error, over the requests it predicted, recent ones
// weighing most; n is their count.
func (m *Model) Calibration() (bias, absErr float64, n int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bias, m.absErr, m.judged
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func fromMS(v float64) time.Duration {
	if v < 0 {
		return -1
	}
	return time.Duration(v * float64(time.Millisecond))
}
