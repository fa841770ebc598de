package measure

import (
	"net/netip"
	"testing"
	"time"
)

func TestPathFloors(t *testing.T) {
	var f pathFloors
	a, b := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("10.0.0.2")
	t0 := time.Unix(1000, 0)
	if got := f.floor(a, 0, t0); got != 0 {
		t.Fatalf("no sample yet: %v", got)
	}
	if got := f.floor(a, 20*time.Millisecond, t0); got != 20*time.Millisecond {
		t.Fatalf("first sample: %v", got)
	}
	// A handshake that met a queue: the address's floor is the lower.
	if got := f.floor(a, 150*time.Millisecond, t0.Add(time.Second)); got != 20*time.Millisecond {
		t.Fatalf("after a higher sample: %v", got)
	}
	if got := f.floor(b, 0, t0); got != 0 {
		t.Fatalf("another address: %v", got)
	}
	if got := f.floor(a, 15*time.Millisecond, t0.Add(2*time.Second)); got != 15*time.Millisecond {
		t.Fatalf("a lower sample: %v", got)
	}
	// Past the window the old floor no longer counts: the path got slower.
	later := t0.Add(2*time.Second + floorWindow + time.Second)
	if got := f.floor(a, 0, later); got != 0 {
		t.Fatalf("expired floor still given: %v", got)
	}
	if got := f.floor(a, 30*time.Millisecond, later); got != 30*time.Millisecond {
		t.Fatalf("sample after expiry: %v", got)
	}
	if got := f.floor(netip.Addr{}, 7*time.Millisecond, later); got != 7*time.Millisecond {
		t.Fatalf("no address: %v", got)
	}
}

// TestPathFloorsBounded: a flood of addresses keeps at most maxFloors.
func TestPathFloorsBounded(t *testing.T) {
	var f pathFloors
	now := time.Unix(1000, 0)
	base := netip.MustParseAddr("2001:db8::")
	ip := base
	for range 3 * maxFloors {
		ip = ip.Next()
		f.floor(ip, time.Millisecond, now)
		if len(f.m) > maxFloors {
			t.Fatalf("%d addresses kept, over %d", len(f.m), maxFloors)
		}
	}
	if got := f.floor(ip, 0, now); got != time.Millisecond {
		t.Fatalf("the newest address lost its floor: %v", got)
	}
}
