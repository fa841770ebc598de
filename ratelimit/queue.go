package ratelimit

// The admission queue: requests waiting for their tenant's limits, admitted
// in order as they allow (pumpLocked), against a shared store by a
// goroutine of the queue's own (pumpShared).

import (
	"time"
)

func retryAfter(wait time.Duration) time.Duration {
	if wait <= 0 {
		return time.Second
	}
	return wait
}

// sharedPoll is how often a queue waiting on a shared store's concurrency
// looks again: the releases of other replicas do not reach this one.
const sharedPoll = 25 * time.Millisecond

// pumpLocked admits queued requests in order while the limits allow, and
// otherwise arranges to try again when the head could pass. st is locked.
// Against a shared store the queue is admitted by one goroutine of its own
// (pumpShared), so that no caller waits on the store's round trips.
func (a *Admitter) pumpLocked(st *tenantState, now time.Time) {
	if a.shared != nil {
		switch {
		case len(st.queue) == 0:
		case st.pumping:
			st.repump = true
		default:
			st.pumping = true
			go a.pumpShared(st)
		}
		return
	}
	for len(st.queue) > 0 {
		w := st.queue[0]
		adm, ok, wait, _ := a.try(st, w.route, w.routeName, w.est, now)
		if !ok {
			if wait <= 0 && a.shared != nil {
				wait = sharedPoll
			}
			if wait > 0 {
				if st.timer != nil {
					st.timer.Stop()
				}
				a.pumpAfter(st, wait)
			}
			return // waiting on a release otherwise
		}
		st.admitHead(w, adm)
	}
}

// pumpAfter has the queue pumped again after wait. st is locked.
func (a *Admitter) pumpAfter(st *tenantState, wait time.Duration) {
	if st.timer != nil {
		st.timer.Stop()
	}
	st.timer = time.AfterFunc(wait, func() {
		st.mu.Lock()
		st.a.pumpLocked(st, st.a.now()) // the Admitter it belongs to by then
		st.mu.Unlock()
	})
}

// admitHead takes the queue's head, w, out of it as admitted. st is locked.
func (st *tenantState) admitHead(w *waiter, adm *admission) {
	st.queue[0] = nil
	st.queue = st.queue[1:]
	st.queued.Add(-1)
	w.admitted, w.adm = true, adm
	close(w.ch)
}

// pumpShared admits the queue's head against the shared store, one
// decision at a time, until the queue is empty or its head must wait; it
// is the only goroutine pumping st's queue while st.pumping is set.
func (a *Admitter) pumpShared(st *tenantState) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for len(st.queue) > 0 {
		w := st.queue[0]
		st.repump = false
		adm, ok, wait, _ := a.try(st, w.route, w.routeName, w.est, a.now())
		if w.gone {
			// It left while the store decided: what it was given goes back.
			if ok {
				t := &Ticket{a: a, st: st, routeName: w.routeName, adm: adm, reserved: w.est}
				st.mu.Unlock()
				t.release(usage{})
				st.mu.Lock()
			}
			continue
		}
		if ok {
			st.admitHead(w, adm)
			continue
		}
		if st.repump {
			continue // a release came while the store decided: at once again
		}
		if wait <= 0 {
			wait = sharedPoll
		}
		a.pumpAfter(st, wait)
		break
	}
	st.pumping = false
}
