package stats

import "time"

// timelineLen is the points a route's timeline keeps: an hour of 10 s
// slots.
const timelineLen = 360

// Point is one 10 s slot of a route, all its models, tenants and
// upstreams together: what the dashboard charts.
type Point struct {
	// T is the slot's start, Unix seconds.
	T                int64   `json:"t"`
	Count            int64   `json:"count"`
	Errors           int64   `json:"errors"`
	RequestsPerS     float64 `json:"requests_per_s"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	// GoodputRatio is null when no request was judged.
	GoodputRatio *float64 `json:"goodput_ratio"`
	TTFTP50      float64  `json:"ttft_p50_ms"`
	TTFTP95      float64  `json:"ttft_p95_ms"`
	TTFTP99      float64  `json:"ttft_p99_ms"`
	ITLP50       float64  `json:"itl_p50_ms"`
	ITLP95       float64  `json:"itl_p95_ms"`
	E2EP50       float64  `json:"e2e_p50_ms"`
	E2EP95       float64  `json:"e2e_p95_ms"`
	QueueP95     float64  `json:"queue_p95_ms"`
	OverheadP95  float64  `json:"overhead_p95_ms"`
	// ClientTTFTP50 is the client's TTFT p50, network included.
	ClientTTFTP50 float64 `json:"client_ttft_p50_ms"`
	// Partial marks the newest point: its slot is still open, and requests
	// in flight in it are counted only when they end, so its rates run low.
	Partial bool `json:"partial,omitempty"`
}

func point(a *agg, span time.Duration) Point {
	p := Point{Count: a.count, Errors: a.errors,
		RequestsPerS:     round3(float64(a.count) / span.Seconds()),
		OutputTokensPerS: round3(float64(a.outTokens) / span.Seconds()),
		TTFTP50:          round3(a.d[mTTFT].quantile(0.5)),
		TTFTP95:          round3(a.d[mTTFT].quantile(0.95)),
		TTFTP99:          round3(a.d[mTTFT].quantile(0.99)),
		ITLP50:           round3(a.d[mITL].quantile(0.5)),
		ITLP95:           round3(a.d[mITL].quantile(0.95)),
		E2EP50:           round3(a.d[mE2E].quantile(0.5)),
		E2EP95:           round3(a.d[mE2E].quantile(0.95)),
		QueueP95:         round3(a.d[mQueue].quantile(0.95)),
		OverheadP95:      round3(a.d[mOverhead].quantile(0.95)),
		ClientTTFTP50:    round3(a.d[mClientTTFT].quantile(0.5)),
	}
	if a.judged > 0 {
		r := round3(float64(a.good) / float64(a.judged))
		p.GoodputRatio = &r
	}
	return p
}

// timeline is a ring of a route's closed slots.
type timeline struct {
	slot [timelineLen]int64 // the slot each entry holds (0: none yet)
	p    [timelineLen]Point
}

func (t *timeline) put(k int64, p Point) {
	i := mod(k, timelineLen)
	p.T = slotStart(k).Unix()
	t.slot[i], t.p[i] = k, p
}

// RouteTimeline is one route's last hour; on a route with several
// upstreams, with upstreams asked for, each upstream's too.
type RouteTimeline struct {
	Route     string             `json:"route"`
	Points    []Point            `json:"points"`
	Upstreams []UpstreamTimeline `json:"upstreams,omitempty"`
}

// UpstreamTimeline is one upstream of a route over the last hour.
type UpstreamTimeline struct {
	Upstream string  `json:"upstream"`
	Points   []Point `json:"points"`
}

// TimelineReport is the /stats/timeline answer: per route, a point per
// 10 s slot of the last hour (slots without requests have count 0), the
// last one the open slot so far.
type TimelineReport struct {
	StepS  int             `json:"step_s"`
	Routes []RouteTimeline `json:"routes"`
}
