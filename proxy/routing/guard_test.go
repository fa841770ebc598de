package routing

import (
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// A guard limited to a class weighs only that class's requests.
func TestGuardLimitedToAClass(t *testing.T) {
	g := newGuardState(Guard{Candidate: "c", Baseline: "b", Class: "in-long.out-short", MaxTTFTP95Increase: 0.1}, time.Now())
	for _, class := range []string{"in-long.out-short", "in-short.out-short", "in-long.out-short"} {
		r := &metrics.Record{Class: class, TTFT: time.Millisecond, E2E: time.Millisecond}
		g.observe("c", r)
		g.observe("b", r)
	}
	if g.sides[0].Count() != 2 || g.sides[1].Count() != 2 {
		t.Fatalf("sides %d and %d, want 2 each (the class's requests only)", g.sides[0].Count(), g.sides[1].Count())
	}
}
