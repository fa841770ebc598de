package telemetry

import (
	"sync"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// inbox is the records on their way to the exporter's goroutine: the
// requests' goroutines append to it under its lock, and the exporter's
// goroutine takes all of it at once, giving back the slices it emptied.
// The records are written into the same few kilobytes again and again,
// warm in the caches; a channel of the queue's size (8,192 records of
// 824 bytes) went round 6.7 MB, and each record written and read missed
// them twice.
//
// The exporter's goroutine takes the records wakeAt at a time (the
// wakeAt-th record wakes it) and, whatever the inbox holds, every
// gatherEvery. Woken for each record, with the proxy's work in between
// (its code and data gone from the caches), a record cost it about four
// times the CPU, and its wake-ups and a timer's kept Go's scheduler and
// its monitor busy.
type inbox struct {
	mu    sync.Mutex
	items []item
	gaps  []time.Duration // the streamed records' gaps, back to back
	max   int
	wake  chan struct{} // poked by the wakeAt-th record
}

// wakeAt is the records that wake the exporter's goroutine; gatherEvery
// is how long a record waits at most when fewer come.
const (
	wakeAt      = 64
	gatherEvery = time.Second
)

// item is one finished record on its way to the exporter's goroutine.
type item struct {
	rec   metrics.Record
	model string          // the model's metric label: only models of the config (bounded cardinality)
	gaps  []time.Duration // streamed responses, with metrics on: set when taken
	from  int             // its gaps in the inbox's
	to    int
}

func newInbox(max int) *inbox {
	return &inbox{max: max, wake: make(chan struct{}, 1)}
}

// put copies r, its metric label and gaps in, or reports that the inbox
// is full.
func (b *inbox) put(r *metrics.Record, model string, traced bool, gaps []time.Duration) bool {
	b.mu.Lock()
	if len(b.items) >= b.max {
		b.mu.Unlock()
		return false
	}
	b.items = append(b.items, item{})
	it := &b.items[len(b.items)-1]
	it.rec, it.model = *r, model
	it.rec.Series, it.rec.TenantSeries = nil, nil
	it.rec.Trace.Sampled = traced
	it.from = len(b.gaps)
	b.gaps = append(b.gaps, gaps...)
	it.to = len(b.gaps)
	wake := len(b.items) == wakeAt
	b.mu.Unlock()
	if wake {
		select {
		case b.wake <- struct{}{}:
		default:
		}
	}
	return true
}

// maxKeptItems bounds the records' slice kept from one take to the next
// once it has grown past what it held (a burst), so that a burst's memory
// is given back.
const maxKeptItems = 1024

// take returns what the inbox holds, and gives it items and gaps, emptied,
// to fill next.
func (b *inbox) take(items []item, gaps []time.Duration) ([]item, []time.Duration) {
	clear(items) // the records' strings are the requests'
	if cap(items) > maxKeptItems && len(items) < cap(items)/4 {
		items, gaps = nil, nil
	}
	b.mu.Lock()
	its, gs := b.items, b.gaps
	b.items, b.gaps = items[:0], gaps[:0]
	b.mu.Unlock()
	for i := range its {
		its[i].gaps = gs[its[i].from:its[i].to]
	}
	return its, gs
}
