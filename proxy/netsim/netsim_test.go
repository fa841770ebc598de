//go:build linux

package netsim

import (
	"context"
	"io"
	"os"
	"testing"
	"time"
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
	go func() {
		c, err := ln.Accept()
		if err == nil {
			_, _ = io.Copy(io.Discard, c)
			c.Close()
		}
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
	time.Sleep(200 * time.Millisecond)
	l.Close()
	d, f := l.Dropped, l.Forwarded
	if share := float64(d) / float64(d+f); d == 0 || share < 0.1 || share > 0.3 {
		t.Errorf("dropped %d of %d packets", d, d+f)
	}
}
