package proxy

import (
	"net"
	"testing"
	"time"
)

// A client that leaves once the upstream's response has ended (settle)
// cancels nothing: the upstream connection stays open for the pool and the
// exchange is not gone. Before it, leaving cancels and closes.
func TestCancelAfterSettleCancelsNothing(t *testing.T) {
	for _, settled := range []bool{false, true} {
		a, b := net.Pipe()
		var c cancelState
		if !c.attach(a) {
			t.Fatal("attach refused on a fresh exchange")
		}
		done := c.doneChan()
		if settled {
			c.settle()
		}
		c.fire()
		closed := a.SetDeadline(time.Time{}) != nil // net.Pipe: io.ErrClosedPipe once closed
		select {
		case <-done:
			if settled {
				t.Error("settled: the done channel closed")
			}
		default:
			if !settled {
				t.Error("not settled: the done channel stayed open")
			}
		}
		if c.isGone() != !settled || closed != !settled {
			t.Errorf("settled %v: gone %v, upstream connection closed %v", settled, c.isGone(), closed)
		}
		a.Close()
		b.Close()
	}
}
