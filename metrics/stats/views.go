package stats

// The engine's queries besides Query: the sketches behind a table (for
// merging across replicas), a route's timeline, and the comparison of two
// upstreams. Each reads under the engine's locks and returns a copy.

import (
	"slices"
	"time"
)

// QuerySketches is Query's groups as counts and sketches, to merge with
// other replicas' (MergeSketches).
func (e *Engine) QuerySketches(q Query) SketchReport {
	if q.Window == "" {
		q.Window = "5m"
	}
	now := e.now()
	sums, order, targets, span := e.collect(q, now)
	rep := SketchReport{Format: SketchFormat, Window: q.Window, WindowS: span.Seconds(), GeneratedAt: now.UTC(), Groups: []SketchGroup{}}
	for _, k := range order {
		if a := sums[k]; a.count > 0 {
			rep.Groups = append(rep.Groups, sketchGroup(k, a, targets[k]))
		}
	}
	return rep
}

// Timeline returns the last hour of route (all routes when "").
func (e *Engine) Timeline(route string) TimelineReport { return e.TimelineOf(route, false) }

// TimelineOf is Timeline, with each upstream's last hour too on routes
// with several when upstreams is set.
func (e *Engine) TimelineOf(route string, upstreams bool) TimelineReport {
	now := e.now()
	s := e.sync(now)
	rep := TimelineReport{StepS: int(slotLen / time.Second), Routes: []RouteTimeline{}}
	e.mu.RLock()
	defer e.mu.RUnlock()
	startSlot := max(slotOf(e.start), s-timelineLen+1)
	span := now.Sub(slotStart(s))
	if st := e.start; st.After(slotStart(s)) {
		span = now.Sub(st)
	}
	span = max(span, time.Second)
	open := newAgg()
	// series reads a timeline's closed slots and the open slot so far of
	// the groups that keep.
	series := func(tl *timeline, keep func(Key) bool) []Point {
		pts := make([]Point, 0, s-startSlot+1)
		for k := startSlot; k < s; k++ {
			i := mod(k, timelineLen)
			if tl.slot[i] == k {
				pts = append(pts, tl.p[i])
			} else {
				pts = append(pts, Point{T: slotStart(k).Unix()})
			}
		}
		open.clear()
		for _, g := range e.list {
			if keep(g.key) && !g.key.Shadow {
				g.mu.Lock()
				open.merge(&g.w.open)
				g.mu.Unlock()
			}
		}
		p := point(&open, span)
		p.T, p.Partial = slotStart(s).Unix(), true
		return append(pts, p)
	}
	for _, r := range e.routes {
		if route != "" && r != route {
			continue
		}
		rt := RouteTimeline{Route: r, Points: series(e.tl[r], func(k Key) bool { return k.Route == r })}
		if upstreams && len(e.ups[r]) > 1 {
			for _, u := range e.ups[r] {
				rt.Upstreams = append(rt.Upstreams, UpstreamTimeline{Upstream: u,
					Points: series(e.utl[[2]string{r, u}], func(k Key) bool { return k.Route == r && k.Upstream == u })})
			}
		}
		rep.Routes = append(rep.Routes, rt)
	}
	return rep
}

// Compare compares upstreams a and b of route over window (every model
// and tenant together), class by class where the requests fall in
// several (strata.go).
func (e *Engine) Compare(route, a, b, window string) (Comparison, error) {
	return e.CompareClass(route, a, b, window, "")
}

// CompareClass is Compare on the requests of one class ("": all, within
// classes).
func (e *Engine) CompareClass(route, a, b, window, class string) (Comparison, error) {
	if window == "" {
		window = "5m"
	}
	now := e.now()
	s := e.sync(now)
	byClass := map[string]*[2]agg{}
	e.mu.RLock()
	list := slices.Clone(e.list)
	e.mu.RUnlock()
	for _, g := range list {
		if g.key.Route != route || (g.key.Upstream != a && g.key.Upstream != b) || (class != "" && g.key.Class != class) {
			continue
		}
		pair := byClass[g.key.Class]
		if pair == nil {
			pair = &[2]agg{newAgg(), newAgg()}
			byClass[g.key.Class] = pair
		}
		side := 0
		if g.key.Upstream == b {
			side = 1
		}
		g.mu.Lock()
		g.w.collect(&pair[side], window, s)
		g.mu.Unlock()
	}
	return compareAggs(route, a, b, window, class, byClass)
}
