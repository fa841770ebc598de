package ratelimit

import "time"

// budget is a token budget per minute: a bucket of capacity tokens refilled
// at capacity per minute, whose level may go below zero.
//
// golang.org/x/time/rate (used for request rates) cannot do what a token
// budget needs: give back part of a reservation when a response used fewer
// tokens than reserved, or charge more than the burst when it used more.
// Here a reservation is taken whole before forwarding, and Reconcile moves
// the level by the difference once the real usage is known; a negative
// level is debt that later requests wait out.
type budget struct {
	capacity float64
	perSec   float64
	level    float64
	last     time.Time
}

func newBudget(perMinute int64, now time.Time) *budget {
	c := float64(perMinute)
	return &budget{capacity: c, perSec: c / 60, level: c, last: now}
}

func (b *budget) refill(now time.Time) {
	if dt := now.Sub(b.last).Seconds(); dt > 0 {
		b.level = min(b.capacity, b.level+dt*b.perSec)
		b.last = now
	}
}

// need is what must be available to admit an estimate of n tokens: n, but
// never more than the whole capacity, so a request larger than the budget
// still passes when the budget is full (and leaves it in debt).
func (b *budget) need(n int64) float64 { return min(float64(n), b.capacity) }

// wait returns how long until n tokens can be reserved (0: now).
func (b *budget) wait(now time.Time, n int64) time.Duration {
	b.refill(now)
	short := b.need(n) - b.level
	if short <= 0 {
		return 0
	}
	return time.Duration(short / b.perSec * float64(time.Second))
}

func (b *budget) take(now time.Time, n int64) {
	b.refill(now)
	b.level -= float64(n)
}

// reconcile replaces a reservation of reserved tokens by the actual use.
func (b *budget) reconcile(now time.Time, reserved, actual int64) {
	b.refill(now)
	b.level = min(b.capacity, b.level+float64(reserved-actual))
}

// untilFull is how long until the budget is full again.
func (b *budget) untilFull(now time.Time) time.Duration {
	b.refill(now)
	return time.Duration((b.capacity - b.level) / b.perSec * float64(time.Second))
}
