package proxy

import (
	"sync"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// looker is what a lookWatch looks at: a socket whose TCP_INFO is read at
// times it chooses.
type looker interface {
	// nextLook is when the next look is due.
	nextLook() time.Time
	// lookNow looks once at now and reports whether the watch of it is
	// over (it then does what its end asks). ti is the watch's own buffer
	// for the reading, the looker's to use during the call.
	lookNow(now time.Time, ti *sock.TCPInfo) bool
}

// lookWatch looks at every looker due, from one goroutine that runs while
// any wait and ends when none do. A goroutine per response cost its
// creation, a sleep per look and the growth of a fresh stack (3% of the
// CPU on short streams); here one wake-up serves every look that is due.
// The proxy has two: the records waiting for the client's acknowledgement
// of a response's end (ackWatch), and the first tokens' bytes waiting for
// theirs (ackMark).
type lookWatch struct {
	mu      sync.Mutex
	waiting []looker
	running bool
	wakeAt  time.Time     // when the goroutine looks next
	wake    chan struct{} // an earlier look is due than wakeAt
	due     []looker      // the goroutine's own: looks due, and those to
	again   []looker      // look at again,
	ti      sock.TCPInfo  // and the buffer its looks read TCP_INFO into
}

// add watches l; now is the clock the looks are timed by.
func (w *lookWatch) add(l looker, now func() time.Time) {
	w.mu.Lock()
	w.waiting = append(w.waiting, l)
	start, signal := !w.running, w.running && l.nextLook().Before(w.wakeAt)
	if start {
		w.running = true
		if w.wake == nil {
			w.wake = make(chan struct{}, 1)
		}
	}
	w.mu.Unlock()
	switch {
	case start:
		go w.run(now)
	case signal:
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

func (w *lookWatch) run(now func() time.Time) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		t := now()
		w.mu.Lock()
		keep, next := w.waiting[:0], time.Time{}
		for _, l := range w.waiting {
			at := l.nextLook()
			if !at.After(t) {
				w.due = append(w.due, l)
				continue
			}
			keep = append(keep, l)
			if next.IsZero() || at.Before(next) {
				next = at
			}
		}
		clear(w.waiting[len(keep):])
		w.waiting = keep
		if len(w.due) == 0 && len(keep) == 0 {
			w.running = false
			w.mu.Unlock()
			return
		}
		w.wakeAt = next
		if len(w.due) > 0 {
			w.wakeAt = t // looking now: every add wakes the next round early
		}
		w.mu.Unlock()

		if len(w.due) > 0 {
			for i, l := range w.due {
				w.due[i] = nil
				if !l.lookNow(now(), &w.ti) {
					w.again = append(w.again, l)
				}
			}
			w.due = w.due[:0]
			if len(w.again) > 0 {
				w.mu.Lock()
				w.waiting = append(w.waiting, w.again...)
				w.mu.Unlock()
				clear(w.again)
				w.again = w.again[:0]
			}
			continue
		}
		timer.Reset(next.Sub(t))
		select {
		case <-timer.C:
		case <-w.wake:
		}
	}
}
