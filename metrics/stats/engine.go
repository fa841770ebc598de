// Package stats keeps tokentap's live percentiles: per route × model ×
// tenant × upstream, the count, errors, throughput, goodput and the
// distribution of every measure (TTFT, TTFA, ITL, TPOT, E2E, queue,
// overhead, upstream TTFB) over sliding windows of one minute, five
// minutes, one hour and since start, and the warnings they raise.
//
// Distributions are DDSketches (github.com/DataDog/sketches-go): a
// quantile is within RelativeAccuracy of the exact value of the same rank,
// heavy tails included; memory per group is constant; sketches of the same
// measure merge, so groups (and, later, replicas) combine exactly as if
// their samples had been one.
//
//	e := stats.New(stats.Options{})
//	e.Observe(&rec, gaps)                        // once per finished request
//	rep := e.Query(stats.Query{Window: "5m"})    // the /stats table
//	tl := e.Timeline("")                         // the last hour, per route
package stats

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// Options tune the engine.
type Options struct {
	// Now is the clock of the windows (default time.Now). Only which slot
	// a request lands in depends on it; the measures come in the records.
	Now func() time.Time
	// Thresholds of the warnings.
	Warn WarnOptions
	// MaxGroups bounds the groups held (default DefaultMaxGroups); a
	// request whose group would pass it goes into its route × model ×
	// upstream × class's group of FoldedTenant.
	MaxGroups int
}

// Bounds of the table's memory. A group costs about 9 KB once it saw a
// request and up to ~1 MB when busy with widely spread values in every
// slot of the hour (27 aggs of 12 sketches); IdleGroup after its last
// request it is evicted, its all-time figures folded into FoldedTenant's
// group of its labels.
const (
	DefaultMaxGroups = 2000
	IdleGroup        = time.Hour
	// FoldedTenant is the tenant of the groups that hold what the cap and
	// the eviction folded away.
	FoldedTenant = "(folded)"
)

// idleSlots is IdleGroup in slots: past it nothing but all holds a
// group's requests.
const idleSlots = int64(IdleGroup / slotLen)

// foldKey is the group k folds into.
func foldKey(k Key) Key {
	k.Tenant = FoldedTenant
	return k
}

// Key names one group.
type Key struct {
	Route, Model, Tenant, Upstream string
	// Class is the requests' class (metrics.Record.Class).
	Class string
	// Shadow: copies sent to the route's shadow upstream. They are the
	// upstream's figures only: a query that merges upstreams away (the
	// route's, a tenant's) leaves them out, and so do the route's
	// timeline and trends.
	Shadow bool
}

// group is one Key's windows and the SLO target its requests carried.
type group struct {
	key    Key
	mu     sync.Mutex
	w      *windows
	target float64 // the goodput objective of the last judged request
	last   int64   // the slot of its last request
	dead   bool    // evicted: Observe looks its key up again
}

// Engine is the live percentile table. It is safe for concurrent use.
type Engine struct {
	now   func() time.Time
	start time.Time
	warn  atomic.Pointer[WarnOptions]

	slot   atomic.Int64 // the open slot
	mu     sync.RWMutex // guards groups, routes and timeline; write-held to close slots
	groups map[Key]*group
	list   []*group             // in creation order
	tl     map[string]*timeline // by route
	routes []string             // timeline routes in creation order
	// utl are the timelines of a route's named upstreams (a route with
	// several), ups their names per route in creation order, and
	// upScratch an agg per upstream name for closing slots.
	utl       map[[2]string]*timeline
	ups       map[string][]string
	upScratch map[string]*agg

	// maxGroups bounds len(list); keys past it map to their fold group
	// (aliases counts those entries of groups).
	maxGroups       atomic.Int64
	aliases         int
	folded, evicted atomic.Int64
}

// New returns an empty engine.
func New(o Options) *Engine {
	if o.Now == nil {
		o.Now = time.Now
	}
	e := &Engine{now: o.Now, groups: map[Key]*group{}, tl: map[string]*timeline{},
		utl: map[[2]string]*timeline{}, ups: map[string][]string{}, upScratch: map[string]*agg{}}
	e.start = e.now()
	e.slot.Store(slotOf(e.start))
	e.SetWarn(o.Warn)
	e.SetMaxGroups(o.MaxGroups)
	return e
}

// SetMaxGroups replaces the bound on groups (0: DefaultMaxGroups). Groups
// already held stay; new ones fold past it.
func (e *Engine) SetMaxGroups(n int) {
	if n <= 0 {
		n = DefaultMaxGroups
	}
	e.maxGroups.Store(int64(n))
}

// TableStats is what the table holds and what it folded away.
type TableStats struct {
	Groups int
	// Folded counts requests recorded in a FoldedTenant group because the
	// table was full; Evicted the groups folded after IdleGroup idle.
	Folded, Evicted int64
}

// TableStats returns what the table holds.
func (e *Engine) TableStats() TableStats {
	e.mu.RLock()
	n := len(e.list)
	e.mu.RUnlock()
	return TableStats{Groups: n, Folded: e.folded.Load(), Evicted: e.evicted.Load()}
}

// SetWarn replaces the warning thresholds (zero fields take defaults).
func (e *Engine) SetWarn(w WarnOptions) {
	w = w.withDefaults()
	e.warn.Store(&w)
}

func slotOf(t time.Time) int64 { return t.UnixNano() / int64(slotLen) }

func slotStart(k int64) time.Time { return time.Unix(0, k*int64(slotLen)) }

// Observe adds one finished request, with its inter-token gaps (may be
// nil). Records without a metric series (never routed) are skipped. It
// allocates only for a group's first request.
func (e *Engine) Observe(r *metrics.Record, gaps []time.Duration) {
	if r.Series == nil {
		return
	}
	route, upstream, model := r.Series.Labels()
	k := Key{Route: route, Model: model, Tenant: r.Tenant, Upstream: upstream, Class: r.Class, Shadow: r.Shadow}
	s := slotOf(e.now())
	if s > e.slot.Load() {
		e.advance(s)
	}
	e.mu.RLock()
	g := e.groups[k]
	e.mu.RUnlock()
	for {
		if g == nil {
			g = e.create(k)
		}
		g.mu.Lock()
		if !g.dead {
			break
		}
		g.mu.Unlock() // evicted since it was looked up
		g = nil
	}
	g.w.open.add(r, gaps)
	g.last = s
	if r.SLOJudged {
		g.target = r.SLOTarget
	}
	g.mu.Unlock()
	if g.key.Tenant != k.Tenant {
		e.folded.Add(1)
	}
}

// create returns k's group, made now: its own while the table has room,
// else its fold group, which k then maps to.
func (e *Engine) create(k Key) *group {
	e.mu.Lock()
	defer e.mu.Unlock()
	if g := e.groups[k]; g != nil {
		return g
	}
	if int64(len(e.list)) >= e.maxGroups.Load() && k.Tenant != FoldedTenant {
		g := e.groupLocked(foldKey(k))
		e.groups[k] = g
		e.aliases++
		return g
	}
	return e.groupLocked(k)
}

// groupLocked returns k's group, making it. e.mu is write-held.
func (e *Engine) groupLocked(k Key) *group {
	if g := e.groups[k]; g != nil {
		return g
	}
	g := &group{key: k, w: newWindows(e.slot.Load()), last: e.slot.Load()}
	e.groups[k] = g
	e.list = append(e.list, g)
	if e.tl[k.Route] == nil && !k.Shadow {
		e.tl[k.Route] = &timeline{}
		e.routes = append(e.routes, k.Route)
	}
	if uk := [2]string{k.Route, k.Upstream}; k.Upstream != "" && !k.Shadow && e.utl[uk] == nil {
		e.utl[uk] = &timeline{}
		e.ups[k.Route] = append(e.ups[k.Route], k.Upstream)
		if e.upScratch[k.Upstream] == nil {
			a := newAgg()
			e.upScratch[k.Upstream] = &a
		}
	}
	return g
}

// advance closes slots until s is open, recording each closed slot's
// point on its route's timeline.
func (e *Engine) advance(s int64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	cur := e.slot.Load()
	if s <= cur {
		return
	}
	// Points for at most the last hour of slots; older ones would fall
	// off the timeline at once.
	first := max(cur, s-timelineLen)
	scratch := newAgg()
	for k := cur; k < s; k++ {
		for _, route := range e.routes {
			scratch.clear()
			for _, u := range e.ups[route] {
				e.upScratch[u].clear()
			}
			for _, g := range e.list {
				if g.key.Route != route || g.key.Shadow {
					continue
				}
				g.mu.Lock()
				if k >= first {
					scratch.merge(&g.w.open)
					if g.key.Upstream != "" {
						e.upScratch[g.key.Upstream].merge(&g.w.open)
					}
				}
				g.w.advance(k + 1)
				g.mu.Unlock()
			}
			if k >= first {
				e.tl[route].put(k, point(&scratch, slotLen))
				for _, u := range e.ups[route] {
					e.utl[[2]string{route, u}].put(k, point(e.upScratch[u], slotLen))
				}
			}
		}
		for _, g := range e.list {
			if g.key.Shadow { // no timeline: only their windows move on
				g.mu.Lock()
				g.w.advance(k + 1)
				g.mu.Unlock()
			}
		}
		if k < first {
			// Catch every group up in one step (windows.advance jumps).
			for _, g := range e.list {
				g.mu.Lock()
				g.w.advance(first)
				g.mu.Unlock()
			}
			k = first - 1
		}
	}
	e.slot.Store(s)
	e.evictLocked(s)
}

// evictLocked folds away the groups idle for IdleGroup: nothing but their
// all-time agg holds their requests any more, and it goes into their fold
// group. When that made room, keys that were folded for want of it get
// groups of their own again at their next request. e.mu is write-held.
func (e *Engine) evictLocked(s int64) {
	var dead []*group
	kept := e.list[:0]
	for _, g := range e.list {
		g.mu.Lock()
		if g.key.Tenant != FoldedTenant && s-g.last > idleSlots {
			g.dead = true
			dead = append(dead, g)
		} else {
			kept = append(kept, g)
		}
		g.mu.Unlock()
	}
	clear(e.list[len(kept):])
	e.list = kept
	if len(dead) == 0 {
		return
	}
	for _, g := range dead {
		f := e.groupLocked(foldKey(g.key))
		f.mu.Lock()
		f.w.all.merge(&g.w.all)
		f.target = max(f.target, g.target)
		f.mu.Unlock()
		delete(e.groups, g.key)
	}
	e.evicted.Add(int64(len(dead)))
	if e.aliases > 0 && int64(len(e.list)) < e.maxGroups.Load() {
		for k, g := range e.groups {
			if g.key != k {
				delete(e.groups, k)
			}
		}
		e.aliases = 0
	}
}

// sync closes the slots that ended before now and returns the open slot.
func (e *Engine) sync(now time.Time) int64 {
	s := slotOf(now)
	if s > e.slot.Load() {
		e.advance(s)
	}
	return e.slot.Load()
}

// Query says what to report.
type Query struct {
	// Window is 1m, 5m, 1h or all (default 5m).
	Window string
	// Filters: only groups with these label values ("" matches all).
	Route, Model, Tenant, Upstream, Class string
	// GroupBy lists the labels groups keep (route, model, tenant,
	// upstream, class); the others are merged away and reported as "".
	// Empty: the first four (classes merged).
	GroupBy []string
}

// ValidGroupBy reports whether every name is a label.
func ValidGroupBy(names []string) bool {
	for _, n := range names {
		switch n {
		case "route", "model", "tenant", "upstream", "class":
		default:
			return false
		}
	}
	return true
}

// keepsUpstream says whether q's groups keep the upstream label: only then
// are shadow copies in them (as groups of their own).
func (q Query) keepsUpstream() bool {
	return len(q.GroupBy) == 0 || slices.Contains(q.GroupBy, "upstream")
}

// project keeps of k the labels q groups by.
func (q Query) project(k Key) Key {
	if len(q.GroupBy) == 0 {
		k.Class = ""
		return k
	}
	out := Key{Shadow: k.Shadow}
	for _, n := range q.GroupBy {
		switch n {
		case "route":
			out.Route = k.Route
		case "model":
			out.Model = k.Model
		case "tenant":
			out.Tenant = k.Tenant
		case "upstream":
			out.Upstream = k.Upstream
		case "class":
			out.Class = k.Class
		}
	}
	return out
}

// ValidWindow reports whether w names a window ("" is the default).
func ValidWindow(w string) bool {
	_, ok := windowLens[w]
	return ok || w == ""
}

// Query returns the table for q: one Group per route × model × tenant ×
// upstream that saw a request in the window, in a stable order, and the
// warnings.
func (e *Engine) Query(q Query) Report {
	if q.Window == "" {
		q.Window = "5m"
	}
	now := e.now()
	sums, order, targets, span := e.collect(q, now)
	rep := Report{Window: q.Window, GeneratedAt: now.UTC(), Groups: []Group{}, Warnings: []Warning{}, Guards: []TrippedGuard{}}
	for _, k := range order {
		if a := sums[k]; a.count > 0 {
			rep.Groups = append(rep.Groups, group_(k, a, span, targets[k]))
		}
	}
	rep.WindowS = span.Seconds()
	slices.SortFunc(rep.Groups, func(a, b Group) int { return compareKeys(a.key(), b.key()) })
	e.mu.RLock()
	list := slices.Clone(e.list)
	e.mu.RUnlock()
	rep.Warnings = e.warnings(q, rep.Groups, list, e.slot.Load(), now)
	return rep
}

// collect merges the groups q selects over its window, by the labels it
// keeps, in a stable order of first appearance, with the goodput target
// of each and the time the window covers.
func (e *Engine) collect(q Query, now time.Time) (map[Key]*agg, []Key, map[Key]float64, time.Duration) {
	s := e.sync(now)
	e.mu.RLock()
	list := slices.Clone(e.list)
	e.mu.RUnlock()
	sums, targets := map[Key]*agg{}, map[Key]float64{}
	var order []Key
	span := e.span(windowStart(q.Window, s), now)
	for _, g := range list {
		if !q.matches(g.key) {
			continue
		}
		k := q.project(g.key)
		a := sums[k]
		if a == nil {
			na := newAgg()
			a = &na
			sums[k] = a
			order = append(order, k)
		}
		g.mu.Lock()
		g.w.collect(a, q.Window, s)
		targets[k] = max(targets[k], g.target)
		g.mu.Unlock()
	}
	return sums, order, targets, span
}

// span is the time a window starting at slot from covers at now: never
// before the engine started.
func (e *Engine) span(from int64, now time.Time) time.Duration {
	start := e.start
	if from != math.MinInt64 {
		if t := slotStart(from); t.After(start) {
			start = t
		}
	}
	return max(now.Sub(start), time.Millisecond)
}

func (q Query) matches(k Key) bool {
	if k.Shadow && !q.keepsUpstream() {
		return false
	}
	return (q.Route == "" || q.Route == k.Route) && (q.Model == "" || q.Model == k.Model) &&
		(q.Tenant == "" || q.Tenant == k.Tenant) && (q.Upstream == "" || q.Upstream == k.Upstream) &&
		(q.Class == "" || q.Class == k.Class)
}

func compareKeys(a, b Key) int {
	for _, p := range [][2]string{{a.Route, b.Route}, {a.Model, b.Model}, {a.Tenant, b.Tenant}, {a.Upstream, b.Upstream}, {a.Class, b.Class}} {
		if p[0] != p[1] {
			if p[0] < p[1] {
				return -1
			}
			return 1
		}
	}
	switch {
	case a.Shadow == b.Shadow:
		return 0
	case b.Shadow:
		return -1
	}
	return 1
}
