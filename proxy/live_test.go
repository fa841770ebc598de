package proxy

import (
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/relay"
)

// Every test of this package runs with the release check on.
func init() { checkLive = true }

// A part that outlives its request cannot reach the exchange it was
// released with: each way in (the relay's Sink, the tap's AckMarker, the
// watch of waiting records) panics, naming it; taken again from the pool,
// the exchange is live.
func TestReleasedExchangeIsUnreachable(t *testing.T) {
	p := newProxyForBench(t)
	x := acquireExchange(p, p.snap.Load(), time.Now())
	var sink relay.Sink = x // what a relay that outlived its request holds
	releaseExchange(x)
	for name, use := range map[string]func(){
		"Observe":    func() { sink.Observe([]byte("data: x\n\n"), time.Now()) },
		"Delivered":  func() { sink.Delivered(time.Now()) },
		"ClientLeft": func() { sink.ClientLeft() },
		"Finish":     func() { sink.Finish(nil) },
		"MarkAcks":   func() { x.MarkAcks(true, true, time.Now(), 1) },
		"NextLook":   func() { x.NextLook() },
	} {
		func() {
			defer func() {
				if r, _ := recover().(string); !strings.Contains(r, "after its release") {
					t.Errorf("%s on a released exchange: recovered %q, want the release panic", name, r)
				}
			}()
			use()
		}()
	}
	y := acquireExchange(p, p.snap.Load(), time.Now())
	defer releaseExchange(y)
	y.Observe(nil, time.Now()) // live again: no panic
}
