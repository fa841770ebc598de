package proxy

import (
	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
)

// The end of a request runs a list of observers, built once per
// configuration (observersOf, in Apply): the learners first (the
// upstream's prediction, its backend's cache and slot times, the route's
// guard), then the reporters (the route's series and goodput, the live
// stats table, each sink: the access log, OTel). Adding one is a line in
// observersOf, not an edit of record.

// An observer is told of each finished exchange, its record complete:
// complete says whether its body came whole.
type observer interface {
	observe(x *exchange, complete bool)
}

// observerFunc is an observer made of a function.
type observerFunc func(x *exchange, complete bool)

func (f observerFunc) observe(x *exchange, complete bool) { f(x, complete) }

// observersOf builds the observers of a configuration generation, in the
// order each finished exchange is told.
func observersOf(p *Proxy, s *snapshot) []observer {
	obs := []observer{
		// A copy counts in its upstream's /stats group and the access log
		// only: never in goodput, the route's series or its guard.
		observerFunc(func(x *exchange, _ bool) {
			if !x.shadow {
				x.judge()
				s.metrics.Observe(&x.rec)
			}
		}),
	}
	if !p.opts.NoStats {
		obs = append(obs, statsObserver{p.stats})
	}
	obs = append(obs, observerFunc((*exchange).learnEnd), observerFunc(noteBackend), observerFunc(guard))
	for _, sink := range p.opts.Sinks {
		if g, ok := sink.(metrics.GapSink); ok {
			obs = append(obs, gapSink{g})
			continue
		}
		obs = append(obs, plainSink{sink})
	}
	return obs
}

// statsObserver feeds the live /stats table: the record and its gaps into
// the open slot of its group.
type statsObserver struct{ eng *stats.Engine }

func (o statsObserver) observe(x *exchange, _ bool) { o.eng.Observe(&x.rec, x.tap.Gaps()) }

// noteBackend tells the upstream that served the request what its
// backend's prompt cache did and, where the backend reports its queue, how
// long the request held it.
func noteBackend(x *exchange, _ bool) {
	m, rec := x.att.mem, &x.rec
	if m == nil || rec.Attempts == 0 {
		return
	}
	if rec.CachedTokens >= 0 {
		m.Cache.Note(rec.CachedTokens, rec.TTFT.Microseconds())
	}
	if m.Scrape != nil && rec.Outcome == metrics.OutcomeOK && rec.E2E > 0 {
		m.NoteSlot(rec.E2E - max(rec.Queue, 0))
	}
}

// guard tells the route's canary guard of the request (not of a shadow
// copy), and has it look.
func guard(x *exchange, _ bool) {
	if x.rt != nil && !x.shadow {
		x.rt.set.Guarded(x.att.mem, &x.rec, x.in.stickyKey, x.in.stickyKeyed, x.p.statsNow, x.p.log)
	}
}

// gapSink and plainSink hand the record to a sink: with its inter-token gaps
// where the sink takes them (metrics.GapSink), else alone.
type (
	gapSink   struct{ s metrics.GapSink }
	plainSink struct{ s metrics.Sink }
)

func (o gapSink) observe(x *exchange, _ bool)   { o.s.ObserveGaps(&x.rec, x.tap.Gaps()) }
func (o plainSink) observe(x *exchange, _ bool) { o.s.Observe(&x.rec) }
