// Package inbox hands values from many goroutines to one: the access log's
// records to its writer, the OTel export's to its exporter. The senders
// fill their values in place, under the box's lock, into fixed chunks
// that go back to the box once the receiver has drained them, so the same few
// kilobytes are written again and again, warm in the caches, and a burst
// costs new chunks, never a copy of the ones filled (an append's growth,
// under the lock, would hold every sender for as long). A channel of the
// queue's length went round all of it (6.5 MB for 8,192 records), each
// value written and read cold, and all of it stayed resident and scanned
// by every collection.
package inbox

import "sync"

// chunkLen is the values a chunk holds.
const chunkLen = 64

// keptChunks is the empty chunks a box keeps for the next values; past
// them a burst's chunks are let go.
const keptChunks = 8

// Box is an inbox of T. The zero value is not usable: New.
type Box[T any] struct {
	mu     sync.Mutex
	chunks [][]T // filled in order, the last one with room
	n      int   // values in chunks
	max    int
	wakeAt int
	closed bool
	free   [][]T // empty chunks, given back
	// Wake is poked when the box reaches wakeAt values, and at Close.
	Wake chan struct{}

	headers [][]T // the drainer's own: the chunks' headers of its last drain
}

// New returns a box that refuses a bounded put past max values and pokes
// Wake at wakeAt (1: when it stops being empty).
func New[T any](max, wakeAt int) *Box[T] {
	return &Box[T]{max: max, wakeAt: wakeAt, Wake: make(chan struct{}, 1)}
}

// Put adds a value and lets fill set it, under the box's lock (fill must
// be short and must not call the box). It reports false, adding nothing,
// when the box is closed, or full for a bounded put.
func (b *Box[T]) Put(bounded bool, fill func(*T)) bool {
	b.mu.Lock()
	if b.closed || bounded && b.n >= b.max {
		b.mu.Unlock()
		return false
	}
	last := len(b.chunks) - 1
	if last < 0 || len(b.chunks[last]) == cap(b.chunks[last]) {
		var c []T
		if k := len(b.free); k > 0 {
			c, b.free = b.free[k-1], b.free[:k-1]
		} else {
			c = make([]T, 0, chunkLen)
		}
		b.chunks = append(b.chunks, c)
		last++
	}
	c := b.chunks[last]
	var zero T
	c = append(c, zero)
	fill(&c[len(c)-1])
	b.chunks[last] = c
	b.n++
	wake := b.n == b.wakeAt
	b.mu.Unlock()
	if wake {
		b.poke()
	}
	return true
}

func (b *Box[T]) poke() {
	select {
	case b.Wake <- struct{}{}:
	default:
	}
}

// Drain calls f on every value put so far, in order, and gives their
// chunks back; it reports how many values it saw and whether the box is
// closed. One goroutine drains a box.
func (b *Box[T]) Drain(f func(*T)) (n int, closed bool) {
	chunks, closed := b.take(b.headers)
	for _, c := range chunks {
		for i := range c {
			f(&c[i])
		}
		n += len(c)
	}
	b.give(chunks)
	b.headers = chunks
	return n, closed
}

// take returns the chunks filled so far, in order, and whether the box is
// closed; into is an emptied slice for the chunks' headers, returned to
// the drainer's use.
func (b *Box[T]) take(into [][]T) ([][]T, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	chunks := b.chunks
	b.chunks, b.n = into[:0], 0
	return chunks, b.closed
}

// give takes back chunks that were read: cleared (the values may hold the
// senders' memory) and kept for the next values, up to keptChunks.
func (b *Box[T]) give(chunks [][]T) {
	for _, c := range chunks {
		clear(c)
	}
	b.mu.Lock()
	for i, c := range chunks {
		if len(b.free) < keptChunks {
			b.free = append(b.free, c[:0])
		}
		chunks[i] = nil
	}
	b.mu.Unlock()
}

// Close refuses every later put and pokes Wake.
func (b *Box[T]) Close() {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.poke()
}
