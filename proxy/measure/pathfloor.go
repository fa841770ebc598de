package measure

import (
	"net/netip"
	"sync"
	"time"
)

// pathFloors remembers, per client address, the lowest round trip its
// connections measured lately. A connection's own first sample is its
// handshake's, and a handshake that met a queue on the way to the client
// (a bottleneck that the address's other streams fill) measures the queue
// too: its first token's acknowledgement then comes well before the round
// trip the connection believes in, and a mark that waits for that long
// looks too late to time it (tokenack.go). The address's earlier
// connections knew the path's minimum.
//
// A sample counts for floorWindow, as the kernel's own windowed minimum
// does (net.ipv4.tcp_min_rtt_wlen, 300 s): a client that moved, or a path
// that got slower, shows within it. At most maxFloors addresses are kept;
// beyond, an arbitrary one gives its place (a floor only times looks, so a
// missing one costs precision, never correctness).
type pathFloors struct {
	mu sync.Mutex
	m  map[netip.Addr]pathFloor
}

type pathFloor struct {
	rtt time.Duration
	at  time.Time // when the sample was taken
}

const (
	floorWindow = 300 * time.Second
	maxFloors   = 4096
)

// floor notes rtt (0: none) as a sample of ip's path at now and returns
// the lowest round trip ip's path showed within the window, rtt included
// (0: none known).
func (f *pathFloors) floor(ip netip.Addr, rtt time.Duration, now time.Time) time.Duration {
	if !ip.IsValid() {
		return rtt
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	e, ok := f.m[ip]
	if ok && now.Sub(e.at) > floorWindow {
		ok = false
	}
	if rtt <= 0 {
		if ok {
			return e.rtt
		}
		return 0
	}
	if ok && e.rtt <= rtt {
		return e.rtt
	}
	if f.m == nil {
		f.m = make(map[netip.Addr]pathFloor)
	}
	if _, known := f.m[ip]; !known && len(f.m) >= maxFloors {
		// Full: the expired go, then arbitrary ones down to three
		// quarters, so that the next thousand addresses cost no sweep.
		for k, old := range f.m {
			if now.Sub(old.at) > floorWindow {
				delete(f.m, k)
			}
		}
		for k := range f.m {
			if len(f.m) <= maxFloors*3/4 {
				break
			}
			delete(f.m, k)
		}
	}
	f.m[ip] = pathFloor{rtt: rtt, at: now}
	return rtt
}
