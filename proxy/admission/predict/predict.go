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
	"slices"
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
	staleFloor  = 0.002
	// minPairs is the requests the per-token cost needs before it is
	// believed (each measured beside others of its level), and minSpread
	// the spread of their inputs about their levels' means (the
	// regression's Σ(x − x̄)², in tokens²): inputs that differ by less
	// than a token say nothing of what a token costs, and requests all of
	// one size leave only the rounding of the running means there, a
	// slope read off which is noise (107 ms a token, from thirty requests
	// of 10 tokens, which a request of 23 tokens turned into 1.4 s).
	minPairs  = 20
	minSpread = 1.0
)

// level is what the requests started at one in-flight level lived: an
// average of their TTFT and input tokens and of their TPOT, in
// milliseconds, each request weighing exp(−age/tau), and the weights. The
// TTFT is kept as measured, and brought to the reference input size when
// the curve is fitted, by the per-token cost known then: an early guess
// at that cost corrupts no level.
type level struct {
	ttft, in, tpot float64
	w, wTPOT       float64
	at, tpotAt     time.Time // the last first token's, the last TPOT's
}

// Model is one upstream's model.
type Model struct {
	now func() time.Time

	mu     sync.Mutex
	levels []level // by in-flight level at start, up to the highest seen
	// The cost of each input token: a regression, pooled over the levels
	// and with forgetting, of a request's TTFT less its level's mean on
	// its input less its level's mean; believed from minPairs requests.
	// inRef is the reference input size (a running mean).
	inRef, sxy, sxx float64
	pairs           int
	// done is the completions a second (exponential average over ~5 s)
	// and doneAt the last completion: how fast a queue drains; first and
	// firstAt the same of first tokens, known a prefill after a request
	// starts where its completion comes a response later.
	done, first     float64
	doneAt, firstAt time.Time
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
	wBuf, yBuf    []float64 // the fit's scratch: the levels' weights and figures
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
// the model said before it was sent (negative: nothing), for its error. It
// is ObserveFirst and ObserveEnd at once, for a request whose first token
// is learned at its end.
func (m *Model) Observe(k, in int, ttft, tpot, predicted time.Duration) {
	if ttft >= 0 {
		m.ObserveFirst(k, in, ttft, predicted)
	}
	m.ObserveEnd(k, tpot)
}

// ObserveFirst adds the first token of a request that started with k
// others in flight on the upstream and had in input tokens: it came ttft
// after the request was sent. predicted is what the model said before it
// was sent (negative: nothing), for its error. Learned as the first token
// comes, a level is known a prefill after the load reaches it, not a
// whole response later.
func (m *Model) ObserveFirst(k, in int, ttft, predicted time.Duration) {
	now := m.now()
	k = min(max(k, 0), MaxLevel)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.first, m.firstAt = rate(m.first, m.firstAt, now), now
	l := m.level(k)
	y, x := ms(ttft), float64(in)
	if m.pairs == 0 && m.inRef == 0 {
		m.inRef = x
	}
	m.inRef += 0.01 * (x - m.inRef)
	if l.w > 0 {
		const forget = 0.999
		m.sxy = forget*m.sxy + (x-l.in)*(y-l.ttft)
		m.sxx = forget*m.sxx + (x-l.in)*(x-l.in)
		m.pairs++
	}
	// The level's averages, its requests' weight decayed since the last.
	l.w *= math.Exp(-float64(now.Sub(l.at)) / float64(tau))
	l.ttft, l.in = (l.ttft*l.w+y)/(l.w+1), (l.in*l.w+x)/(l.w+1)
	l.w++
	m.seen++
	l.at = now
	if predicted >= 0 && y > 0 {
		e := (ms(predicted) - y) / y
		m.judged++
		a := max(1/float64(m.judged), 0.05)
		m.bias += a * (e - m.bias)
		m.absErr += a * (math.Abs(e) - m.absErr)
	}
}

// ObserveEnd adds the end of a request that started with k others in
// flight: its time per output token (negative: not measured), and a
// completion in the completion rate.
func (m *Model) ObserveEnd(k int, tpot time.Duration) {
	now := m.now()
	k = min(max(k, 0), MaxLevel)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.completed(now)
	if tpot < 0 {
		return
	}
	l := m.level(k)
	l.wTPOT *= math.Exp(-float64(now.Sub(l.tpotAt)) / float64(tau))
	l.tpot = (l.tpot*l.wTPOT + ms(tpot)) / (l.wTPOT + 1)
	l.wTPOT++
	l.tpotAt = now
	m.seen++
}

// level returns level k's figures, made up to it. m.mu is held.
func (m *Model) level(k int) *level {
	for len(m.levels) <= k {
		m.levels = append(m.levels, level{})
	}
	return &m.levels[k]
}

// Measured is the highest level at which a first token was measured
// within Stale (−1: none).
func (m *Model) Measured() int {
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for k := len(m.levels) - 1; k >= 0; k-- {
		if l := &m.levels[k]; l.w > 0 && now.Sub(l.at) <= Stale {
			return k
		}
	}
	return -1
}

// completed counts a completion at now in the completion rate. m.mu is
// held.
func (m *Model) completed(now time.Time) {
	if m.doneAt.IsZero() {
		m.doneAt = now
		return
	}
	m.done, m.doneAt = rate(m.done, m.doneAt, now), now
}

// rate is an event rate r, of the last event at at, with one more event
// at now: an exponential average over 5 s, each event adding a fifth and
// the rate decaying by exp(−dt/5 s) in between.
func rate(r float64, at, now time.Time) float64 {
	const tau = 5.0
	if at.IsZero() {
		return 1 / tau
	}
	return r*math.Exp(-now.Sub(at).Seconds()/tau) + 1/tau
}

// perToken is the TTFT cost of one input token, in ms (never negative).
// m.mu is held.
func (m *Model) perToken() float64 {
	if m.sxx < minSpread || m.pairs < minPairs {
		return 0
	}
	return max(m.sxy/m.sxx, 0)
}

// Predict returns the TTFT and TPOT a request of in input tokens would
// live if sent now with k requests in flight on the upstream (in < 0: of
// the usual size); ok is false
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
	if in >= 0 {
		t += m.perToken() * (float64(in) - m.inRef)
	}
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
// flight never makes the first token come sooner), and never less past
// the knee than before it (a request waiting its turn costs more than
// one sharing the batch).
func (m *Model) fitLevels(now time.Time) fit {
	n := len(m.levels)
	m.wBuf, m.yBuf = slices.Grow(m.wBuf[:0], n)[:n], slices.Grow(m.yBuf[:0], n)[:n]
	w := m.wBuf
	clear(w)
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
			w[i] = max(staleWeight*math.Exp(-float64(now.Sub(l.at)-Stale)/float64(4*tau)), staleFloor)
		}
	}
	if total < minWeight {
		return fit{}
	}
	// Every knee's normal equations come from sums over the levels on
	// each side of it: running sums make the search linear in the levels.
	// Each level's TTFT at the reference input size.
	pt := m.perToken()
	y := m.yBuf
	var left, all sums
	for i := range m.levels {
		y[i] = m.levels[i].ttft - pt*(m.levels[i].in-m.inRef)
		all.add(w[i], float64(i), y[i])
	}
	best, bestErr := fit{ok: true}, math.Inf(1)
	for c := 0; c < n; c++ {
		left.add(w[c], float64(c), y[c])
		f, e := fitKnee(&left, &all, float64(c))
		if e < bestErr {
			best, bestErr = f, e
		}
	}
	// A physical bound on the slopes: in a queue served in order, each
	// request ahead delays a new one by one completion's interval, and
	// the completion rate now is at most the rate the server can keep
	// up; twice its interval bounds a slope read off levels few requests
	// saw (an early burst, figures gone stale) from growing without
	// reason, and keeps a guess nothing refreshes (requests refused at
	// levels it put too high) from holding itself up.
	if rate := m.done * math.Exp(-now.Sub(m.doneAt).Seconds()/5); rate > 0 {
		most := 2 * 1000 / rate
		best.b1, best.b2 = min(best.b1, most), min(best.b2, most)
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

// sums are the weighted sums over levels i of figures y that a knee's
// normal equations are made of.
type sums struct{ w, i, i2, y, iy, y2 float64 }

func (s *sums) add(w, i, y float64) {
	if w == 0 {
		return
	}
	s.w, s.i, s.i2 = s.w+w, s.i+w*i, s.i2+w*i*i
	s.y, s.iy, s.y2 = s.y+w*y, s.iy+w*i*y, s.y2+w*y*y
}

// fitKnee is the weighted least-squares fit of the TTFT curve with its knee
// at c, and its weighted squared error; left holds the sums of the levels
// up to c, all those of every level.
func fitKnee(left, all *sums, c float64) (fit, float64) {
	// Normal equations of y = a + b1·u + b2·v, u = min(k, c), v = max(0,
	// k − c): levels up to c have u = k, v = 0; those past it u = c, v =
	// k − c.
	rw, ri, ri2 := all.w-left.w, all.i-left.i, all.i2-left.i2
	ry, riy := all.y-left.y, all.iy-left.iy
	v1 := ri - c*rw
	s := [3][3]float64{
		{all.w, left.i + c*rw, v1},
		{left.i + c*rw, left.i2 + c*c*rw, c * v1},
		{v1, c * v1, ri2 - 2*c*ri + c*c*rw},
	}
	r := [3]float64{all.y, left.iy + c*ry, riy - c*ry}
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
	switch {
	case !use[2]:
		// Nothing measured past the knee, or a slope that fell: one line
		// goes on past it.
		f.b2 = f.b1
	case f.b2 < f.b1:
		// A curve that climbs less once the batch is full is no queue:
		// each request ahead costs a whole turn there, more than a place
		// in the batch did. Such a knee is a few figures past it read
		// low (a level counted a request the backend had just finished,
		// or one that reached it after this), and believing it would
		// admit requests at levels nobody measured; the line through
		// every level, the last knee's fit, is what the figures say.
		return fit{}, math.Inf(1)
	}
	// The weighted squared error, Σw(y − x·β)², from the same sums.
	beta := [3]float64{f.a, f.b1, f.b2}
	e := all.y2
	for p := range 3 {
		e -= 2 * beta[p] * r[p]
		for q := range 3 {
			e += beta[p] * s[p][q] * beta[q]
		}
	}
	return f, e
}

// solve solves the normal equations s·x = r for the coefficients in use
// (the others 0), by Gaussian elimination.
func solve(s [3][3]float64, r [3]float64, use [3]bool) ([3]float64, bool) {
	var idx [3]int
	n := 0
	for i, u := range use {
		if u {
			idx[n] = i
			n++
		}
	}
	var a [3][4]float64
	for i := range n {
		for j := range n {
			a[i][j] = s[idx[i]][idx[j]]
		}
		a[i][n] = r[idx[i]]
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
	for i := range n {
		out[idx[i]] = a[i][n] / a[i][i]
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
		if in >= 0 {
			t += m.perToken() * (float64(in) - m.inRef)
		}
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

// CompletionRate is the upstream's requests completed a second lately
// (an exponential average over about 5 s).
func (m *Model) CompletionRate() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.done * math.Exp(-m.now().Sub(m.doneAt).Seconds()/5)
}

// ServedRate is the upstream's requests a second that got their first
// token or completed lately, the larger (exponential averages over about
// 5 s): how fast it takes requests in, known from its first tokens before
// any completes.
func (m *Model) ServedRate() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	return max(m.done*math.Exp(-now.Sub(m.doneAt).Seconds()/5), m.first*math.Exp(-now.Sub(m.firstAt).Seconds()/5))
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

// Knee is the level where the fitted curve's batch is full and requests
// start to queue (MaxLevel while nothing is believed).
func (m *Model) Knee() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.curve(m.now())
	if !f.ok {
		return MaxLevel
	}
	return f.c
}
