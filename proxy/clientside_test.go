package proxy

import (
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
