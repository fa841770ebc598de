package relayplane

import (
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestCrowdingOf(t *testing.T) {
	for _, c := range []struct {
		runnable, procs uint64
		want            crowding
	}{
		{0, 1, calm},
		{busyAt - 1, 1, calm},
		{busyAt, 1, busy},
		{crowdedAt - 1, 1, busy},
		{crowdedAt, 1, crowded},
		{2000, 1, crowded},
		{busyAt, 2, calm}, // per processor
		{2 * busyAt, 2, busy},
		{2*crowdedAt - 1, 2, busy},
		{2 * crowdedAt, 2, crowded},
		{busyAt, 0, busy}, // no processors read: one
	} {
		if got := crowdingOf(c.runnable, c.procs); got != c.want {
			t.Errorf("crowdingOf(%d, %d) = %d, want %d", c.runnable, c.procs, got, c.want)
		}
	}
}

// TestPacingSeesTheQueue reads the runtime's own count: calm with
// nothing runnable, crowded while many more goroutines than crowdedAt a
// processor keep yielding (each is runnable but for its own turn).
func TestPacingSeesTheQueue(t *testing.T) {
	look := newPacing()
	waitFor := func(want crowding) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for look.level() != want {
			if time.Now().After(deadline) {
				t.Fatalf("level %d, want %d (%+v)", look.level(), want, look.samples)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitFor(calm)
	var stop atomic.Bool
	var wg sync.WaitGroup
	n := 4 * crowdedAt * runtime.GOMAXPROCS(0)
	for range n {
		wg.Go(func() {
			for !stop.Load() {
				runtime.Gosched()
			}
		})
	}
	waitFor(crowded)
	stop.Store(true)
	wg.Wait()
	waitFor(calm)
	if allocs := testing.AllocsPerRun(100, func() { look.level() }); allocs != 0 {
		t.Errorf("a look allocates %.0f times", allocs)
	}
}
