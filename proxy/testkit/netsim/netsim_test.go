//go:build linux

package netsim

import (
	"context"
	"fmt"
	"io"
	"os"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

func TestMain(m *testing.M) {
	ServeForwarder()
	os.Exit(m.Run())
}

func need(t *testing.T) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skip("no delay link on this machine:", err)
	}
}

// TestLinkDelays sends a byte back and forth across a 20 ms link: each
// round trip takes at least 40 ms, and not much more.
func TestLinkDelays(t *testing.T) {
	wait.Long(t, "a delayed link")
	need(t)
	l, err := New(Options{Delay: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ln, err := l.A.Listen("tcp", "10.77.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.Copy(c, c)
	}()
	start := time.Now()
	c, err := l.B.Dial(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if d := time.Since(start); d < 40*time.Millisecond {
		t.Errorf("connect took %v, under one round trip", d)
	}
	b := []byte{1}
	var best time.Duration
	for i := range 5 {
		t0 := time.Now()
		if _, err := c.Write(b); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			t.Fatal(err)
		}
		rtt := time.Since(t0)
		if rtt < 40*time.Millisecond {
			t.Errorf("round trip %v under 40 ms", rtt)
		}
		if i == 0 || rtt < best {
			best = rtt
		}
	}
	if best > 60*time.Millisecond {
		t.Errorf("best round trip %v: the forwarder adds more than 20 ms", best)
	}
	t.Logf("best round trip over a 2 × 20 ms link: %v", best)
}

// TestLinkLoses drops about the share asked for.
func TestLinkLoses(t *testing.T) {
	wait.Long(t, "a lossy link")
	need(t)
	l, err := New(Options{Delay: time.Millisecond, Loss: 0.2, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ln, err := l.A.Listen("tcp", "10.77.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	arrived := make(chan int64, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			arrived <- -1
			return
		}
		n, _ := io.Copy(io.Discard, c)
		c.Close()
		arrived <- n
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := l.B.Dial(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	// TCP recovers from every loss: all bytes arrive, some sent again.
	if _, err := c.Write(make([]byte, 200_000)); err != nil {
		t.Fatal(err)
	}
	c.Close()
	select {
	case n := <-arrived:
		if n != 200_000 {
			t.Fatalf("%d bytes arrived of 200000", n)
		}
	case <-ctx.Done():
		t.Fatal("the bytes did not all arrive within 20 s")
	}
	l.Close()
	d, f := l.Dropped, l.Forwarded
	if share := float64(d) / float64(d+f); d == 0 || share < 0.1 || share > 0.3 {
		t.Errorf("dropped %d of %d packets", d, d+f)
	}
}

// TestLateOn reads the ports of TCP packets and finds the late ones of a
// connection within a request's span.
func TestLateOn(t *testing.T) {
	pkt := make([]byte, 40)
	pkt[0], pkt[9] = 0x45, 6 // IPv4, 20-byte header, TCP
	pkt[20], pkt[21], pkt[22], pkt[23] = 0x1f, 0x90, 0xc3, 0x50
	if s, d := tcpPorts(pkt); s != 8080 || d != 50000 {
		t.Fatalf("ports %d → %d, want 8080 → 50000", s, d)
	}
	pkt[9] = 17 // UDP
	if s, d := tcpPorts(pkt); s != 0 || d != 0 {
		t.Fatalf("a UDP packet read as ports %d → %d", s, d)
	}
	if s, d := tcpPorts(pkt[:10]); s != 0 || d != 0 {
		t.Fatalf("a cut packet read as ports %d → %d", s, d)
	}
	t0 := time.Unix(1000, 0)
	l := &Link{}
	l.out.WriteString("3 97\n")
	for _, p := range []Late{
		{Due: t0.Add(10 * time.Millisecond), By: time.Millisecond, SrcPort: 8080, DstPort: 50000},
		{Due: t0.Add(20 * time.Millisecond), By: 3 * time.Millisecond, SrcPort: 50000, DstPort: 8080},
		{Due: t0.Add(90 * time.Millisecond), By: 9 * time.Millisecond, SrcPort: 8080, DstPort: 50000},
		{Due: t0.Add(15 * time.Millisecond), By: 7 * time.Millisecond, SrcPort: 8080, DstPort: 50001},
	} {
		l.out.WriteString(fmt.Sprintf("%d %d %d %d\n", p.Due.UnixNano(), p.By, p.SrcPort, p.DstPort))
	}
	l.readCounts()
	if l.Dropped != 3 || l.Forwarded != 97 || len(l.Late) != 4 {
		t.Fatalf("read %d dropped, %d forwarded, %d late", l.Dropped, l.Forwarded, len(l.Late))
	}
	for _, c := range []struct {
		port     uint16
		from, to time.Duration
		want     time.Duration
	}{
		{50000, 0, 50 * time.Millisecond, 3 * time.Millisecond}, // both directions, the worst
		{50000, 0, 15 * time.Millisecond, time.Millisecond},
		{50000, 30 * time.Millisecond, 80 * time.Millisecond, 0}, // none due then
		{50001, 0, time.Second, 7 * time.Millisecond},
		{50002, 0, time.Second, 0},
	} {
		if got := l.LateOn(c.port, t0.Add(c.from), t0.Add(c.to)); got != c.want {
			t.Errorf("LateOn(%d, +%v, +%v) = %v, want %v", c.port, c.from, c.to, got, c.want)
		}
	}
}

// TestLinkQueues: 64 KiB a server in A sends at once over a 1 MiB/s link
// reach its client in B in about 64 ms more than the delay: they queue
// behind the bottleneck. The way back has no such limit.
func TestLinkQueues(t *testing.T) {
	need(t)
	l, err := New(Options{Delay: 5 * time.Millisecond, Rate: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ln, err := l.A.Listen("tcp", "10.77.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		b := make([]byte, 1)
		for {
			if _, err := io.ReadFull(c, b); err != nil {
				return
			}
			n := 1
			if b[0] == 2 {
				n = 64 << 10
			}
			if _, err := c.Write(make([]byte, n)); err != nil {
				return
			}
		}
	}()
	c, err := l.B.Dial(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := make([]byte, 64<<10)
	for range 3 { // warm windows
		c.Write([]byte{1})
		if _, err := io.ReadFull(c, b[:1]); err != nil {
			t.Fatal(err)
		}
	}
	start := time.Now()
	c.Write([]byte{2})
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatal(err)
	}
	d := time.Since(start)
	// 64 KiB at 1 MiB/s is 62.5 ms on the wire, whatever the window does.
	if d < 60*time.Millisecond {
		t.Fatalf("64 KiB over a 1 MiB/s link in %v: not queued", d)
	}
	t.Logf("64 KiB over a 1 MiB/s link, 5 ms one way: %v after the request", d)
}
