package inbox

import (
	"sync"
	"testing"
)

type value struct{ writer, seq int }

// Values put from many goroutines while another takes them come out once
// each, every writer's in the order it put them, and the bound refuses
// what is past it without adding anything.
func TestEveryValueOnceInOrder(t *testing.T) {
	const writers, each = 8, 2000
	b := New[value](writers*each, 1)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for i := range each {
				if !b.Put(true, func(v *value) { v.writer, v.seq = w, i }) {
					t.Errorf("writer %d's value %d refused below the bound", w, i)
				}
			}
		})
	}
	next := make([]int, writers)
	read := func(chunks [][]value) {
		for _, c := range chunks {
			if len(c) == 0 || len(c) > chunkLen {
				t.Fatalf("a chunk of %d values", len(c))
			}
			for _, v := range c {
				if v.seq != next[v.writer] {
					t.Fatalf("writer %d: value %d came where %d was next", v.writer, v.seq, next[v.writer])
				}
				next[v.writer]++
			}
		}
		b.give(chunks)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	var chunks [][]value
	for running := true; running; {
		select {
		case <-done:
			running = false
		case <-b.Wake:
		}
		chunks, _ = b.take(chunks)
		read(chunks)
	}
	chunks, _ = b.take(chunks)
	read(chunks)
	for w, n := range next {
		if n != each {
			t.Errorf("writer %d: %d values came out of %d", w, n, each)
		}
	}

	small := New[value](3, 1)
	for i := range 5 {
		if got := small.Put(true, func(*value) {}); got != (i < 3) {
			t.Errorf("bounded put %d into a box of 3: %v", i+1, got)
		}
	}
	if !small.Put(false, func(*value) {}) {
		t.Error("an unbounded put refused by the bound")
	}
	chunks, closed := small.take(nil)
	if n := len(chunks[0]); n != 4 || closed {
		t.Errorf("took %d values (closed %v), want the 3 and the unbounded one", n, closed)
	}
	small.Close()
	if small.Put(false, func(*value) {}) {
		t.Error("a put after Close was taken")
	}
	if _, closed := small.take(nil); !closed {
		t.Error("take does not say the box is closed")
	}
}

// The wakeAt-th value pokes Wake, and only it; Close pokes it too.
func TestWakesAtItsCount(t *testing.T) {
	b := New[value](1000, 5)
	for i := 1; i <= 9; i++ {
		b.Put(true, func(*value) {})
		if woken := len(b.Wake) == 1; woken != (i >= 5) {
			t.Fatalf("after %d values: woken %v", i, woken)
		}
	}
	<-b.Wake
	b.Close()
	if len(b.Wake) != 1 {
		t.Error("Close did not poke Wake")
	}
}

// Once its chunks have been given back, the box puts and drains without
// allocating: the same chunks go round. A burst's chunks past
// keptChunks are let go.
func TestChunksGoRound(t *testing.T) {
	b := New[value](1<<20, 1)
	check := func(v *value) {
		if v.seq != 1 {
			t.Fatal("a value came out as it was not put: a chunk given back was not cleared, or reused while read")
		}
	}
	cycle := func(n int) {
		for range n {
			b.Put(true, func(v *value) { v.seq = 1 })
		}
		b.Drain(check)
	}
	cycle(3 * chunkLen)
	if allocs := testing.AllocsPerRun(100, func() { cycle(3 * chunkLen) }); allocs != 0 {
		t.Errorf("%v allocations a cycle once the chunks were given back", allocs)
	}
	cycle(40 * chunkLen)
	if len(b.free) != keptChunks {
		t.Errorf("%d chunks kept after a burst of 40, want %d", len(b.free), keptChunks)
	}
	for _, c := range b.free {
		for _, v := range c[:cap(c)] {
			if v.seq != 0 {
				t.Fatal("a chunk kept holds a value given back: not cleared")
			}
		}
	}
}
