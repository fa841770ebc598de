package downstream

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
		var c Cancel
		if !c.Attach(a) {
			t.Fatal("attach refused on a fresh exchange")
		}
		done := c.Done()
		if settled {
			c.Settle()
		}
		c.Fire()
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
		if c.IsGone() != !settled || closed != !settled {
			t.Errorf("settled %v: gone %v, upstream connection closed %v", settled, c.IsGone(), closed)
		}
		a.Close()
		b.Close()
	}
}
