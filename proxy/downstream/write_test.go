//go:build linux

package downstream

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
)

// keptPair is a loopback connection tokentap's side of which is a Conn,
// and a client that plays a kept-alive HTTP client: it reads a token
// write of tok bytes and then an end of end bytes, and sends its next
// request (a byte) as soon as the end came, which puts its socket in
// Linux's interactive mode.
func keptPair(t *testing.T, tok, end int) (*Conn, *net.TCPConn, chan []byte) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	tc := s.(*net.TCPConn)
	t.Cleanup(func() { client.Close(); tc.Close() })
	cc := NewConn(sock.NewConn(tc, false), 5*time.Second)
	if cc.Sys, err = tc.SyscallConn(); err != nil {
		t.Fatal(err)
	}
	var ti sock.TCPInfo
	cc.Accepted(&ti)
	got := make(chan []byte, 64)
	go func() {
		b := make([]byte, tok+end)
		for {
			if _, err := io.ReadFull(client, b[:tok]); err != nil {
				return
			}
			if _, err := io.ReadFull(client, b[tok:]); err != nil {
				return
			}
			got <- bytes.Clone(b)
			if _, err := client.Write([]byte{'r'}); err != nil {
				return
			}
		}
	}()
	return cc, tc, got
}

// TestSplitWriteAcknowledgedAsItComes: a kept-alive client holds its
// acknowledgement of a lone small write (a first token whose next bytes
// come later) for its delayed-acknowledgement timer, 40 ms at least on
// Linux; the same bytes written split (Conn.Split) leave as two
// segments, are acknowledged as the client reads them, and arrive
// unchanged. SplitAt marks the split write's end. No split is asked
// while the client holds one of ours unacknowledged: the write is its
// second segment.
func TestSplitWriteAcknowledgedAsItComes(t *testing.T) {
	const tok, end = 120, 5
	cc, tc, got := keptPair(t, tok, end)
	var ti sock.TCPInfo
	if !ti.Read(cc.Sys) {
		t.Skip("no TCP_INFO here")
	}
	base := int64(ti.Info.Bytes_acked)
	req := make([]byte, 1)
	// ackedIn waits up to 100 ms for the client to acknowledge what was
	// written, looking every 200 µs, and says how long it took.
	ackedIn := func(from time.Time) time.Duration {
		tick := time.NewTicker(200 * time.Microsecond)
		defer tick.Stop()
		for now := range tick.C {
			if ti.Read(cc.Sys) && int64(ti.Info.Bytes_acked)-base >= cc.Sent || now.Sub(from) > 100*time.Millisecond {
				return now.Sub(from)
			}
		}
		return 0
	}
	var lone, split []time.Duration
	for i := range 9 {
		body := bytes.Repeat([]byte{byte('a' + i)}, tok)
		ti.Read(cc.Sys)
		segs := ti.Info.Data_segs_out
		on := i%2 == 1
		if on {
			var cs measure.ClientSide
			cs.Start(&cc.Wire)
			if !cs.MaySplit() {
				t.Fatalf("write %d: a kept-alive response may not split", i)
			}
			cs.SplitFirst(&ti)
			if !cc.Split {
				t.Fatalf("write %d: no split asked with every byte acknowledged (%d unacked, %d unsent)", i, ti.Info.Unacked, ti.Info.Notsent_bytes)
			}
		}
		start := time.Now()
		if _, err := cc.Write(body); err != nil {
			t.Fatal(err)
		}
		took := ackedIn(start)
		ti.Read(cc.Sys)
		wantSegs := map[bool]uint32{false: 1, true: 2}[on]
		if n := ti.Info.Data_segs_out - segs; n != wantSegs {
			t.Errorf("write %d (split %v) left in %d segments, want %d", i, on, n, wantSegs)
		}
		if on && cc.SplitAt != cc.Sent {
			t.Errorf("split write %d: SplitAt %d, want the count at its end %d", i, cc.SplitAt, cc.Sent)
		}
		if cc.Split {
			t.Errorf("write %d left the split asked for the next", i)
		}
		if _, err := cc.Write(bytes.Repeat([]byte{'.'}, end)); err != nil {
			t.Fatal(err)
		}
		if b := <-got; !bytes.Equal(b[:tok], body) {
			t.Fatalf("write %d reached the client as %q", i, b[:tok])
		}
		if _, err := io.ReadFull(tc, req); err != nil {
			t.Fatal(err)
		}
		switch {
		case i == 0: // the client's socket is not interactive yet
		case on:
			split = append(split, took)
		default:
			lone = append(lone, took)
		}
	}
	// A split write's acknowledgement waits only for the client's read
	// (scheduling on a busy machine): one late of four is allowed.
	late := 0
	for _, d := range split {
		if d >= 30*time.Millisecond {
			late++
		}
	}
	if late > 1 {
		t.Errorf("split writes acknowledged after %v: the client held its acknowledgement", split)
	}
	held := 0
	for _, d := range lone {
		if d >= 30*time.Millisecond {
			held++
		}
	}
	// A client that holds one of our segments unacknowledged (a header
	// written alone) acknowledges a second as it reads it: the write that
	// carries the token then goes out whole, and is acknowledged as it
	// comes.
	ti.Read(cc.Sys)
	segs, splitAt := ti.Info.Data_segs_out, cc.SplitAt
	var cs measure.ClientSide
	cs.Start(&cc.Wire)
	if _, err := cc.Write(bytes.Repeat([]byte{'h'}, tok)); err != nil {
		t.Fatal(err)
	}
	if !cs.MaySplit() {
		t.Fatal("a kept-alive response may not split")
	}
	if cs.SplitFirst(&ti); cc.Split || !cs.Paired() {
		t.Errorf("with a segment of the response's unacknowledged (%d), sent %d ms before: split %v, paired %v, want no split, paired",
			ti.Info.Unacked, ti.Info.Last_data_sent, cc.Split, cs.Paired())
	}
	start := time.Now()
	if _, err := cc.Write(bytes.Repeat([]byte{'.'}, end)); err != nil {
		t.Fatal(err)
	}
	took := ackedIn(start)
	ti.Read(cc.Sys)
	if n := ti.Info.Data_segs_out - segs; n != 2 || cc.SplitAt != splitAt {
		t.Errorf("a write after one unacknowledged left in %d segments with the first (want 2), SplitAt %d (want %d, unchanged)", n, cc.SplitAt, splitAt)
	}
	if took >= 30*time.Millisecond {
		t.Errorf("the second segment was acknowledged after %v, not as it came", took)
	}
	<-got
	t.Logf("acknowledged after: lone writes %v, split %v", lone, split)
	if held < 3 {
		t.Errorf("lone writes acknowledged after %v: the client is not holding its acknowledgements, so the split's are not shown to come sooner", lone)
	}
}
