package telemetry

import (
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// Records put from many goroutines while another takes them all come out
// once each, with their own gaps, and the inbox's bound refuses what is
// past it.
func TestInboxKeepsEveryRecordWithItsGaps(t *testing.T) {
	const writers, each = 8, 500
	b := newInbox(writers * each)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				r := metrics.Record{Route: "r", OutputTokens: w*each + i}
				gaps := make([]time.Duration, i%5) // a record's gaps say whose they are
				for k := range gaps {
					gaps[k] = time.Duration(w*each + i)
				}
				if !b.put(&r, "m", i%2 == 0, gaps) {
					t.Errorf("record %d refused below the bound", w*each+i)
				}
			}
		})
	}
	seen := make([]int, writers*each)
	check := func(items []item) {
		for _, it := range items {
			id := it.rec.OutputTokens
			seen[id]++
			if len(it.gaps) != (id%each)%5 || it.model != "m" || it.rec.Trace.Sampled != ((id%each)%2 == 0) {
				t.Fatalf("record %d: %d gaps, model %q, sampled %v", id, len(it.gaps), it.model, it.rec.Trace.Sampled)
			}
			for _, g := range it.gaps {
				if g != time.Duration(id) {
					t.Fatalf("record %d carries gap %v, another record's", id, g)
				}
			}
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var items []item
	var gaps []time.Duration
	for running := true; running; {
		select {
		case <-done:
			running = false
		default:
		}
		items, gaps = b.take(items, gaps)
		check(items)
	}
	items, _ = b.take(items, gaps)
	check(items)
	for id, n := range seen {
		if n != 1 {
			t.Fatalf("record %d came out %d times", id, n)
		}
	}

	small := newInbox(3)
	r := metrics.Record{}
	for i := range 4 {
		if got := small.put(&r, "", false, nil); got != (i < 3) {
			t.Errorf("put %d into an inbox of 3: %v", i+1, got)
		}
	}
}

// The wakeAt-th record wakes the exporter's goroutine, and only it.
func TestInboxWakesAtABatch(t *testing.T) {
	b := newInbox(1000)
	r := metrics.Record{}
	for i := 1; i <= wakeAt+5; i++ {
		b.put(&r, "", false, nil)
		woken := len(b.wake) == 1
		if woken != (i >= wakeAt) {
			t.Fatalf("after %d records: woken %v", i, woken)
		}
	}
}
