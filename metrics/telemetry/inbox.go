package telemetry

import (
	"slices"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/internal/inbox"
)

// item is one finished record on its way to the exporter's goroutine,
// through the Exporter's inbox (metrics/internal/inbox: a channel of the
// queue's size went round 6.7 MB, each record written and read cold).
// The exporter's goroutine takes the records wakeAt at a time (the
// wakeAt-th record wakes it) and, whatever the inbox holds, every
// gatherEvery. Woken for each record, with the proxy's work in between
// (its code and data gone from the caches), a record cost it about four
// times the CPU, and its wake-ups and a timer's kept Go's scheduler and
// its monitor busy.
type item struct {
	rec   metrics.Record
	model string          // the model's metric label: only models of the config (bounded cardinality)
	gaps  []time.Duration // streamed responses, with metrics on
}

// wakeAt is the records that wake the exporter's goroutine; gatherEvery
// is how long a record waits at most when fewer come.
const (
	wakeAt      = 64
	gatherEvery = time.Second
)

// put copies r, its metric label and gaps into the inbox, or reports that
// it is full (or closed).
func put(b *inbox.Box[item], r *metrics.Record, model string, traced bool, gaps []time.Duration) bool {
	if len(gaps) > 0 {
		gaps = slices.Clone(gaps) // the record's are the exchange's
	}
	return b.Put(true, func(it *item) {
		it.rec, it.model, it.gaps = *r, model, gaps
		it.rec.Series, it.rec.TenantSeries = nil, nil
		it.rec.Trace.Sampled = traced
	})
}
