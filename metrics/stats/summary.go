package stats

import (
	"slices"
	"time"
)

// TrippedGuard is a canary guard that stopped its candidate: shown in
// /stats (guards, and a warning) and on the dashboard.
type TrippedGuard struct {
	Route     string             `json:"route"`
	Candidate string             `json:"candidate"`
	Baseline  string             `json:"baseline"`
	At        time.Time          `json:"at"`
	Reason    string             `json:"reason"`
	Values    map[string]float64 `json:"values"`
}

// Summary is one upstream of a route over a window, every model and
// tenant together: what a canary guard weighs. Its TTFT and E2E leave out
// the time clients caused (the request's upload, the admission queue,
// writes that waited for a slow reader): that is the backend's and
// tokentap's time, which a client cannot draw out.
type Summary struct {
	Count, Errors int64
	TTFTP95       float64 // ms; 0 without streamed requests
	E2EP95        float64 // ms
}

// ErrorRate is Errors / Count (0 without requests).
func (s Summary) ErrorRate() float64 {
	if s.Count == 0 {
		return 0
	}
	return float64(s.Errors) / float64(s.Count)
}

// Summarize returns upstream's summary on route over window.
func (e *Engine) Summarize(route, upstream, window string) Summary {
	s := e.sync(e.now())
	a := newAgg()
	e.mu.RLock()
	list := slices.Clone(e.list)
	e.mu.RUnlock()
	for _, g := range list {
		if g.key.Route == route && g.key.Upstream == upstream {
			g.mu.Lock()
			g.w.collect(&a, window, s)
			g.mu.Unlock()
		}
	}
	return Summary{Count: a.count, Errors: a.errors, TTFTP95: a.d[mBackendTTFT].quantile(0.95), E2EP95: a.d[mBackendE2E].quantile(0.95)}
}
