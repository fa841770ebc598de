package measure

import (
	"sync"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// Looker is what a LookWatch looks at: a socket whose TCP_INFO is read at
// times it chooses.
type Looker interface {
	// NextLook is when the next look is due.
	NextLook() time.Time
	// LookNow looks once at now and reports whether the watch of it is
	// over (it then does what its end asks). ti is the watch's own buffer
	// for the reading, the Looker's to use during the call.
	LookNow(now time.Time, ti *sock.TCPInfo) bool
}

// LookWatch looks at every Looker due, from one goroutine that runs while
// any wait and ends when none do. A goroutine per response cost its
// creation, a sleep per look and the growth of a fresh stack (3% of the
// CPU on short streams); here one wake-up serves every look that is due.
// The proxy has two: the records waiting for the client's acknowledgement
// of a response's end (ackWatch), and the first tokens' bytes waiting for
// theirs (ackMark).
type LookWatch struct {
	mu      sync.Mutex
	waiting []Looker
	running bool
	wakeAt  time.Time     // when the goroutine looks next
	wake    chan struct{} // an earlier look is due than wakeAt
	due     []Looker      // the goroutine's own: looks due, and those to
	again   []Looker      // look at again,
	ti      sock.TCPInfo  // and the buffer its looks read TCP_INFO into
}

// add watches l; now is the clock the looks are timed by.
func (w *LookWatch) Add(l Looker, now func() time.Time) {
	w.mu.Lock()
	w.waiting = append(w.waiting, l)
	start, signal := !w.running, w.running && l.NextLook().Before(w.wakeAt)
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

// Waiting reports how many lookers wait, and whether the goroutine runs.
func (w *LookWatch) Waiting() (n int, running bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.waiting), w.running
}

func (w *LookWatch) run(now func() time.Time) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		t := now()
		w.mu.Lock()
		keep, next := w.waiting[:0], time.Time{}
		for _, l := range w.waiting {
			at := l.NextLook()
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
				if !l.LookNow(now(), &w.ti) {
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
