package measure

import (
	"slices"
	"testing"
	"time"
)

// The path's RTT: the handshake's sample unless the kernel's minimum since
// is clearly below it (a handshake delayed by a queue) or above it (a
// slower path); a minimum just below it may be a millisecond-tick sample.
func TestPathRTT(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	for _, c := range []struct{ min, syn, want time.Duration }{
		{ms(10.2), ms(10.2), ms(10.2)},
		{ms(9.6), ms(10.2), ms(10.2)},  // a timestamp sample, up to 1 ms low
		{ms(10.1), ms(13.3), ms(10.1)}, // the handshake met a queue
		{ms(12), ms(10.2), ms(12)},     // the path got slower
		{0, ms(10.2), ms(10.2)},        // no minimum
		{ms(40.3), 0, ms(40.3)},        // no handshake sample
		{ms(199.4), ms(200.3), ms(200.3)},
	} {
		if got := pathRTT(c.min, c.syn); got != c.want {
			t.Errorf("pathRTT(min %v, handshake %v) = %v, want %v", c.min, c.syn, got, c.want)
		}
	}
}

// The looks at the client's acknowledgement: half a millisecond apart
// while bytes wait unsent, then each pause twice the last; none past the
// wait's end, which a kernel still resending draws out, up to its cap.
func TestAckSchedule(t *testing.T) {
	t0 := time.Unix(1000, 0)
	var cs ClientSide
	d := &cs.deliv
	d.waitUntil, d.waitCap = t0.Add(10*time.Millisecond), t0.Add(maxAckWait)
	now := t0
	var gaps []time.Duration
	for !cs.Schedule(now) {
		gaps = append(gaps, d.next.Sub(now))
		now = d.next
	}
	want := []time.Duration{500 * time.Microsecond, time.Millisecond, 2 * time.Millisecond, 4 * time.Millisecond, 2500 * time.Microsecond}
	if !slices.Equal(gaps, want) || !d.watched {
		t.Fatalf("looks %v apart (watched %v), want %v", gaps, d.watched, want)
	}

	*d = delivery{waitUntil: t0.Add(10 * time.Millisecond), waitCap: t0.Add(maxAckWait), notsent: 100}
	for i := range 3 {
		if cs.Schedule(t0) || d.next.Sub(t0) != 500*time.Microsecond {
			t.Fatalf("unsent bytes, look %d: next in %v", i, d.next.Sub(t0))
		}
	}

	// Past the wait while the kernel resends: an RTO and an RTT more, not
	// past the cap.
	*d = delivery{waitUntil: t0, waitCap: t0.Add(300 * time.Millisecond), recovering: true, rto: 200 * time.Millisecond, srtt: 40 * time.Millisecond}
	if cs.Schedule(t0) || d.waitUntil != t0.Add(240*time.Millisecond) {
		t.Fatalf("resending: over, or the wait ends %v after", d.waitUntil.Sub(t0))
	}
	now = t0.Add(240 * time.Millisecond)
	if cs.Schedule(now) || d.waitUntil != t0.Add(300*time.Millisecond) {
		t.Fatalf("still resending: the wait ends %v after, want the cap", d.waitUntil.Sub(t0))
	}
	if !cs.Schedule(t0.Add(300*time.Millisecond)) || !d.watched {
		t.Fatal("at the cap the wait is over")
	}
}
