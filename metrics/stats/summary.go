package stats

import "time"

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
