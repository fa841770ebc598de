package ratelimit

// A limiter is one set of limits (a tenant's, or a tenant's on a route)
// with its state: the token buckets, the day's and the month's counts, the
// requests in flight.

import (
	"math"
	"time"

	"golang.org/x/time/rate"
)

// usage is what a request is reserved, or used: tokens (input and output)
// and micro-dollars.
type usage struct{ tokens, micro int64 }

// micro is dollars in whole micro-dollars, rounded up (a reservation is
// never short by the rounding).
func micro(usd float64) int64 {
	if usd <= 0 || math.IsNaN(usd) {
		return 0
	}
	return int64(math.Ceil(usd * 1e6))
}

// monthOf is the UTC calendar month of now (months since year 0) and
// how long until the next begins.
func monthOf(now time.Time) (int64, time.Duration) {
	u := now.UTC()
	next := time.Date(u.Year(), u.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	return int64(u.Year())*12 + int64(u.Month()-1), next.Sub(now)
}

// limiter is one set of limits with its state.
type limiter struct {
	lim      Limits
	rps      *rate.Limiter
	tpm      *budget
	day      int64 // the UTC day rpd, tpd and usdDay count
	rpd, tpd int64
	// The dollar budgets' use, in micro-dollars: of the day, and of the
	// UTC month mon.
	usdDay, usdMon int64
	mon            int64
	inflight       int
}

// reconfigure changes a limiter's limits in place: requests in flight stay
// counted, the request bucket keeps its tokens (capped at the new burst)
// and the token budget keeps what was used of it.
func (l *limiter) reconfigure(lim Limits, now time.Time) {
	fresh := newLimiter(lim, now)
	if l.rps != nil && fresh.rps != nil {
		tokens := min(l.rps.TokensAt(now), float64(fresh.rps.Burst()))
		// Bring the new bucket to the old level.
		if spend := int(float64(fresh.rps.Burst()) - tokens); spend > 0 {
			fresh.rps.AllowN(now, spend)
		}
	}
	if l.tpm != nil && fresh.tpm != nil {
		l.tpm.refill(now)
		used := l.tpm.capacity - l.tpm.level
		fresh.tpm.level = fresh.tpm.capacity - used
	}
	l.lim, l.rps, l.tpm = lim, fresh.rps, fresh.tpm
}

func newLimiter(l Limits, now time.Time) *limiter {
	lm := &limiter{lim: l}
	if l.RequestsPerSecond > 0 {
		burst := l.Burst
		if burst == 0 {
			burst = max(1, int(math.Ceil(l.RequestsPerSecond)))
		}
		lm.rps = rate.NewLimiter(rate.Limit(l.RequestsPerSecond), burst)
	}
	if l.TokensPerMinute > 0 {
		lm.tpm = newBudget(l.TokensPerMinute, now)
	}
	return lm
}

// check reports whether an estimate est can be admitted now; if not, how
// long until it can (-1: unknown, waiting on a release).
func (l *limiter) check(now time.Time, est usage) (time.Duration, Reason) {
	if l.lim.MaxConcurrent > 0 && l.inflight >= l.lim.MaxConcurrent {
		return -1, ReasonConcurrency
	}
	var wait time.Duration
	var reason Reason
	if l.rps != nil {
		if tok := l.rps.TokensAt(now); tok < 1 {
			wait = time.Duration((1 - tok) / float64(l.rps.Limit()) * float64(time.Second))
			wait, reason = max(wait, time.Nanosecond), ReasonRequests
		}
	}
	if l.tpm != nil {
		if w := l.tpm.wait(now, est.tokens); w > wait {
			wait, reason = w, ReasonTokens
		}
	}
	if l.lim.RequestsPerDay > 0 || l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		untilDay := time.Unix((l.day+1)*86400, 0).Sub(now)
		if l.lim.RequestsPerDay > 0 && l.rpd >= l.lim.RequestsPerDay && untilDay > wait {
			wait, reason = untilDay, ReasonRequestsDay
		}
		if l.lim.TokensPerDay > 0 && l.tpd+min(est.tokens, l.lim.TokensPerDay) > l.lim.TokensPerDay && untilDay > wait {
			wait, reason = untilDay, ReasonTokensDay
		}
		if b := micro(l.lim.USDPerDay); b > 0 && l.usdDay+min(est.micro, b) > b && untilDay > wait {
			wait, reason = untilDay, ReasonUSDDay
		}
	}
	if b := micro(l.lim.USDPerMonth); b > 0 {
		untilMonth := l.rollMonth(now)
		if l.usdMon+min(est.micro, b) > b && untilMonth > wait {
			wait, reason = untilMonth, ReasonUSDMonth
		}
	}
	return wait, reason
}

// rollDay starts the day's counts afresh when a new UTC day began.
func (l *limiter) rollDay(now time.Time) {
	if d := now.Unix() / 86400; d != l.day {
		l.day, l.rpd, l.tpd, l.usdDay = d, 0, 0, 0
	}
}

// rollMonth starts the month's count afresh when a new UTC month began,
// and returns how long until the next.
func (l *limiter) rollMonth(now time.Time) time.Duration {
	m, until := monthOf(now)
	if m != l.mon {
		l.mon, l.usdMon = m, 0
	}
	return until
}

func (l *limiter) take(now time.Time, est usage) {
	l.inflight++
	if l.rps != nil {
		l.rps.AllowN(now, 1)
	}
	if l.tpm != nil {
		l.tpm.take(now, est.tokens)
	}
	if l.lim.RequestsPerDay > 0 || l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		l.rpd++
		l.tpd += est.tokens
		l.usdDay += est.micro
	}
	if l.lim.USDPerMonth > 0 {
		l.rollMonth(now)
		l.usdMon += est.micro
	}
}

func (l *limiter) release(now time.Time, reserved, actual usage) {
	l.inflight--
	if l.tpm != nil {
		l.tpm.reconcile(now, reserved.tokens, actual.tokens)
	}
	if l.lim.TokensPerDay > 0 || l.lim.USDPerDay > 0 {
		l.rollDay(now)
		l.tpd = max(0, l.tpd+actual.tokens-reserved.tokens)
		l.usdDay = max(0, l.usdDay+actual.micro-reserved.micro)
	}
	if l.lim.USDPerMonth > 0 {
		l.rollMonth(now)
		l.usdMon = max(0, l.usdMon+actual.micro-reserved.micro)
	}
}

// fresh reports that the limiter is as a new one would be: nothing in
// flight and every bucket full.
func (l *limiter) fresh(now time.Time) bool {
	if l == nil {
		return true
	}
	if l.inflight > 0 {
		return false
	}
	if l.rollDay(now); l.rpd > 0 || l.tpd > 0 || l.usdDay > 0 {
		return false // the day's budgets would start again
	}
	if l.rollMonth(now); l.usdMon > 0 {
		return false
	}
	if l.rps != nil && l.rps.TokensAt(now) < float64(l.rps.Burst()) {
		return false
	}
	return l.tpm == nil || l.tpm.untilFull(now) <= 0
}

// scaled is l at share of each limit (a burst or a concurrency at least 1).
func scaled(l Limits, share float64) Limits {
	f := func(v int64) int64 {
		if v == 0 {
			return 0
		}
		return max(1, int64(math.Ceil(float64(v)*share)))
	}
	out := Limits{RequestsPerSecond: l.RequestsPerSecond * share, TokensPerMinute: f(l.TokensPerMinute),
		MaxConcurrent: int(f(int64(l.MaxConcurrent))), RequestsPerDay: f(l.RequestsPerDay), TokensPerDay: f(l.TokensPerDay),
		USDPerDay: l.USDPerDay * share, USDPerMonth: l.USDPerMonth * share}
	if l.RequestsPerSecond > 0 {
		b := l.Burst
		if b == 0 {
			b = max(1, int(math.Ceil(l.RequestsPerSecond)))
		}
		out.Burst = int(f(int64(b)))
	}
	return out
}
