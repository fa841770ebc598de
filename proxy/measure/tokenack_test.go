package measure

import (
	"io"
	"net"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// loopPair returns both ends of a loopback TCP connection: the server's
// (the one tokentap writes to) and the client's.
func loopPair(t *testing.T) (server *net.TCPConn, client net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(); c.Close() })
	return s.(*net.TCPConn), c
}

// ackedBase is what tcpi_bytes_acked counts before any byte is written.
func ackedBase(t *testing.T, s *net.TCPConn) (int64, *sock.TCPInfo) {
	t.Helper()
	sys, _ := s.SyscallConn()
	var ti sock.TCPInfo
	if !ti.Read(sys) {
		t.Skip("no TCP_INFO here")
	}
	return int64(ti.Info.Bytes_acked), &ti
}

// readConn is the server's end of a loopback connection whose client reads
// all it gets: sys to look at, base its tcpi_bytes_acked before any write.
type readConn struct {
	s    *net.TCPConn
	sys  syscall.RawConn
	base int64
}

func newReadConn(t *testing.T) *readConn {
	t.Helper()
	s, c := loopPair(t)
	base, _ := ackedBase(t, s)
	go io.Copy(io.Discard, c)
	sys, _ := s.SyscallConn()
	return &readConn{s: s, sys: sys, base: base}
}

func (r *readConn) write(t *testing.T, n int) {
	t.Helper()
	if _, err := r.s.Write(make([]byte, n)); err != nil {
		t.Fatal(err)
	}
}

// acked waits until the client acknowledged the first n bytes written.
func (r *readConn) acked(t *testing.T, n int64) {
	t.Helper()
	var ti sock.TCPInfo
	wait.Until(t, func() bool { return ti.Read(r.sys) && int64(ti.Info.Bytes_acked) >= r.base+n })
}

// TestAckMarkSeesTheAcknowledgement: a look before the client's kernel
// acknowledged the bytes sees nothing; the next, 0.1 ms later on the
// looks' clock, sees the acknowledgement, which is usable, stamped
// between the two. The shared watch ends a mark by itself.
func TestAckMarkSeesTheAcknowledgement(t *testing.T) {
	r := newReadConn(t)
	sys, base := r.sys, r.base
	flush := time.Now()
	m := newAckMark(sys, base+300, flush, 50*time.Microsecond)
	var ti sock.TCPInfo
	if m.look(flush, &ti) { // nothing written yet
		t.Fatal("the watch ended before the bytes were written")
	}
	r.write(t, 300)
	r.acked(t, 300)
	at := flush.Add(100 * time.Microsecond)
	if !m.look(at, &ti) {
		t.Fatal("the look after the acknowledgement did not end the watch")
	}
	got := m.take()
	ok := !got.IsZero()
	if !ok || got.Before(flush) || got.After(at) {
		t.Fatalf("acknowledgement stamped %v, usable %v: want between the write (%v) and the look that saw it (%v)", got, ok, flush, at)
	}

	r.write(t, 10)
	var w LookWatch
	m2 := newAckMark(sys, base+310, time.Now(), 50*time.Microsecond)
	w.Add(m2, time.Now)
	wait.Until(t, func() bool { // the watch ends the mark
		m2.mu.Lock()
		defer m2.mu.Unlock()
		return m2.over
	})
}

// TestAckMarkUnusableWhenLookedAtLate: an acknowledgement already there at
// the first look, long after the write (a round trip that looked 100 ms
// long), came at a time the looks cannot tell: not usable. One that never
// comes (bytes never written) ends the watch unusable at its limit.
func TestAckMarkUnusableWhenLookedAtLate(t *testing.T) {
	r := newReadConn(t)
	sys, base := r.sys, r.base
	r.write(t, 100)
	flush := time.Now()
	m := newAckMark(sys, base+100, flush, 100*time.Millisecond)
	var ti sock.TCPInfo
	if !m.look(flush.Add(75*time.Millisecond), &ti) {
		t.Fatal("the first look did not end the watch")
	}
	if !m.take().IsZero() {
		t.Fatal("an acknowledgement found 75 ms after the write counted as timed")
	}

	never := newAckMark(sys, base+1000, flush, time.Millisecond)
	if never.look(flush.Add(time.Millisecond), &ti) {
		t.Fatal("a watch ended before its bytes were acknowledged or its limit")
	}
	if !never.look(flush.Add(time.Millisecond+ackGiveUp), &ti) {
		t.Fatal("the watch did not end at its limit")
	}
	if !never.take().IsZero() {
		t.Fatal("bytes never written counted as acknowledged")
	}

	// Later bytes written 10 µs after the token's: the watch goes on once
	// they could have been acknowledged. An acknowledgement of exactly the
	// token's bytes may still come: behind a queue on the path (a
	// bottleneck the client's own streams fill) it comes after the later
	// bytes were written, and it is the queue's measure (a watch that ended
	// there missed the queue by 35 ms at the median behind 32 KiB/s).
	queued := newAckMark(sys, base+1000, flush, time.Millisecond)
	queued.later.Store(flush.Add(10 * time.Microsecond).UnixNano())
	if queued.look(flush.Add(910*time.Microsecond), &ti) || queued.look(flush.Add(5*time.Millisecond), &ti) {
		t.Fatal("the watch ended once the later bytes could have been acknowledged")
	}
	if !queued.take().IsZero() {
		t.Fatal("bytes never written counted as acknowledged")
	}
}

// TestAckMarkLooksPastTheAgreedSpan walks a mark's looks at bytes never
// acknowledged, each at the time it asked for, up to a horizon: none falls
// within AckAgree of the round trip's estimate (a find there changes
// nothing), no gap passes 2 lookLater (the longest whose middle is
// usable), a long path is looked at from three quarters of its round trip
// as before, and a loopback client is first looked at a round trip and
// AckAgree on, where 5 looks were made by then. The first look is a round
// trip's business, not a gap's: on a path whose three quarters of a round
// trip fall within the span, it stays there.
func TestAckMarkLooksPastTheAgreedSpan(t *testing.T) {
	s, _ := loopPair(t)
	base, _ := ackedBase(t, s)
	sys, _ := s.SyscallConn()
	flush := time.Now()
	for _, c := range []struct {
		rtt, horizon, first time.Duration
		looks               int // before the horizon
	}{
		{rtt: 50 * time.Microsecond, horizon: 1100 * time.Microsecond, first: 1050 * time.Microsecond, looks: 1},   // 5 before
		{rtt: 300 * time.Microsecond, horizon: 5300 * time.Microsecond, first: 1300 * time.Microsecond, looks: 16}, // 21 before
		{rtt: 3 * time.Millisecond, horizon: 20 * time.Millisecond, first: 2250 * time.Microsecond},
		{rtt: 20 * time.Millisecond, horizon: 50 * time.Millisecond, first: 15 * time.Millisecond},
	} {
		m := newAckMark(sys, base+1000, flush, c.rtt)
		if got := m.NextLook().Sub(flush); got != c.first {
			t.Errorf("rtt %v: first look %v after the write, want %v", c.rtt, got, c.first)
		}
		est := flush.Add(c.rtt)
		var ti sock.TCPInfo
		prev, looks := flush, 0
		for at := m.NextLook(); at.Before(flush.Add(c.horizon)); at = m.NextLook() {
			if looks > 0 && at.After(est.Add(-AckAgree)) && at.Before(est.Add(AckAgree)) {
				t.Errorf("rtt %v: a look %v after the write, within AckAgree of the round trip", c.rtt, at.Sub(flush))
			}
			if gap := at.Sub(prev); looks > 0 && gap > 2*lookLater {
				t.Errorf("rtt %v: %v between looks %v and %v after the write", c.rtt, gap, prev.Sub(flush), at.Sub(flush))
			}
			looks++
			if m.look(at, &ti) {
				t.Fatalf("rtt %v: the watch ended %v after the write", c.rtt, at.Sub(flush))
			}
			prev = at
		}
		if c.looks > 0 && looks != c.looks {
			t.Errorf("rtt %v: %d looks within %v, want %d", c.rtt, looks, c.horizon, c.looks)
		}
		if !m.take().IsZero() {
			t.Errorf("rtt %v: bytes never written counted as acknowledged", c.rtt)
		}
	}
}

// lookOnce looks at m at now, its last look that found nothing at prev,
// and returns what the record takes: the bytes must be acknowledged by
// then.
func lookOnce(t *testing.T, m *ackMark, prev, now time.Time) time.Time {
	t.Helper()
	var ti sock.TCPInfo
	m.prev = prev
	if !m.look(now, &ti) {
		t.Fatal("an acknowledgement found did not end the watch")
	}
	return m.take()
}

// TestAckMarkWithTheNextWrite: an acknowledgement of exactly the token's
// bytes and the next write's, found after the next write could have been
// acknowledged alone, stands for the next write's arrival (a client in
// Linux's interactive mode acknowledges a small segment once it read a
// second): the token's arrival is the writes' spacing before it, never
// before the round trip's estimate. One that covers more is not usable.
func TestAckMarkWithTheNextWrite(t *testing.T) {
	r := newReadConn(t)
	sys, base := r.sys, r.base
	// 50 bytes of the token, 20 of the next write: acknowledged together.
	r.write(t, 50)
	r.write(t, 20)
	r.acked(t, 70)
	flush := time.Now()
	for _, c := range []struct {
		spacing, want time.Duration // want: after the write, 0 for none
		laterEnd      int64
	}{
		{spacing: 5 * time.Millisecond, want: 24500 * time.Microsecond, laterEnd: 70},
		{spacing: 29 * time.Millisecond, want: time.Millisecond, laterEnd: 70}, // before the estimate
		{spacing: 5 * time.Millisecond, laterEnd: 60},                          // more than the next write
	} {
		m := newAckMark(sys, base+50, flush, time.Millisecond)
		m.laterEnd.Store(base + c.laterEnd)
		m.later.Store(flush.Add(c.spacing).UnixNano())
		// The last look that found nothing 29 ms after the write.
		got := lookOnce(t, m, flush.Add(29*time.Millisecond), flush.Add(30*time.Millisecond))
		switch {
		case c.want == 0 && !got.IsZero():
			t.Errorf("next write ending at %d: usable at %v", c.laterEnd, got.Sub(flush))
		case c.want > 0 && got.Sub(flush) != c.want:
			t.Errorf("next write %v on: token acknowledged at %v, want %v", c.spacing, got.Sub(flush), c.want)
		}
	}
}

// TestAckMarkLooksApartOnABusyMachine: looks further apart than 2
// lookLater (a scheduler that held the watch) still time an
// acknowledgement that came long past the round trip's estimate, where
// their middle errs by an eighth of the delay at most; near the estimate
// they do not.
func TestAckMarkLooksApartOnABusyMachine(t *testing.T) {
	r := newReadConn(t)
	sys, base := r.sys, r.base
	r.write(t, 50)
	r.acked(t, 50)
	flush := time.Now()
	for _, c := range []struct {
		prev, now, want time.Duration // want: 0 for none
	}{
		{prev: 55 * time.Millisecond, now: 60 * time.Millisecond, want: 57500 * time.Microsecond}, // 5 ms apart, 56.5 ms late
		{prev: 5 * time.Millisecond, now: 10 * time.Millisecond},                                  // 5 ms apart, 6.5 ms late
		{prev: 5 * time.Millisecond, now: 7 * time.Millisecond, want: 6 * time.Millisecond},       // 2 ms apart
	} {
		m := newAckMark(sys, base+50, flush, time.Millisecond)
		if got := lookOnce(t, m, flush.Add(c.prev), flush.Add(c.now)); c.want == 0 && !got.IsZero() || c.want > 0 && got.Sub(flush) != c.want {
			t.Errorf("looks at %v and %v after the write: acknowledged at %v (zero: not usable), want %v", c.prev, c.now, got.Sub(flush), c.want)
		}
	}
}

// TestAckMarkNextWriteAtTheDeliveryRate: the next write's bytes arrive at
// least their size over the connection's delivery rate after the token's
// (behind a bottleneck, its share of it), or as far apart as they were
// written if that is longer.
func TestAckMarkNextWriteAtTheDeliveryRate(t *testing.T) {
	flush := time.Now()
	m := newAckMark(nil, 1000, flush, time.Millisecond)
	m.laterEnd.Store(1150) // 150 bytes
	m.later.Store(flush.Add(5 * time.Millisecond).UnixNano())
	ack := flush.Add(100 * time.Millisecond)
	for _, c := range []struct {
		rate uint64
		want time.Duration
	}{
		{rate: 10_000, want: 85 * time.Millisecond},    // 15 ms at 10,000 B/s
		{rate: 1_000_000, want: 95 * time.Millisecond}, // written 5 ms apart
		{rate: 0, want: 95 * time.Millisecond},         // no rate
		{rate: 1_500, want: time.Millisecond},          // 100 ms: the estimate
	} {
		if got := m.withNext(ack, c.rate).Sub(flush); got != c.want {
			t.Errorf("rate %d B/s: the token's arrival %v after the write, want %v", c.rate, got, c.want)
		}
	}
}

// TestAckMarkDelayedAcknowledgement: on a kept-alive connection, an
// acknowledgement of exactly the token's bytes delackFloor or more past
// the round trip's estimate may be the client's delayed acknowledgement,
// unless the next write followed the token within delackFloor (a client
// that delays would have acknowledged both); near the estimate, on a
// connection's first response, or when the token's write went out split
// (which the client acknowledges as it reads it), it is the path's.
func TestAckMarkDelayedAcknowledgement(t *testing.T) {
	flush := time.Now()
	for _, c := range []struct {
		kept, split bool
		late, next  time.Duration // past the estimate; the next write after the token (0: none)
		wantDelayed bool
	}{
		{kept: true, late: 40 * time.Millisecond, wantDelayed: true},
		{kept: true, split: true, late: 40 * time.Millisecond},
		{kept: true, split: true, late: 40 * time.Millisecond, next: 60 * time.Millisecond},
		{kept: true, late: 40 * time.Millisecond, next: 60 * time.Millisecond, wantDelayed: true},
		{kept: true, late: 40 * time.Millisecond, next: 5 * time.Millisecond},
		{kept: true, late: 10 * time.Millisecond},
		{kept: false, late: 40 * time.Millisecond},
	} {
		m := newAckMark(nil, 1000, flush, 20*time.Millisecond)
		m.lagged = c.kept && !c.split
		if c.next > 0 {
			m.later.Store(flush.Add(c.next).UnixNano())
		}
		if got := m.delayed(flush.Add(20*time.Millisecond + c.late)); got != c.wantDelayed {
			t.Errorf("kept %v, split %v, %v late, next write %v on: delayed %v, want %v", c.kept, c.split, c.late, c.next, got, c.wantDelayed)
		}
	}
}

// TestAckMarkEnded: at the response's end, an acknowledgement not yet seen
// ends the watch unusable on a kept-alive connection when the one that
// could still be read would be of the response's last bytes (the token's,
// or the next write's), which may come with the client's next request;
// the watch goes on for a connection's first response, for a token's
// write that went out split, or when bytes followed those. One the end's
// reading sees is read as a look's.
func TestAckMarkEnded(t *testing.T) {
	flush := time.Now()
	end := flush.Add(100 * time.Microsecond)
	for _, c := range []struct {
		kept       bool
		split      bool
		laterEnd   int64 // the next write's end (0: none)
		total      int64 // the connection's count at the end
		acked      int64
		wantOver   bool
		wantUsable bool
	}{
		{kept: true, total: 1000, wantOver: true},
		{kept: true, split: true, total: 1000},
		{kept: true, laterEnd: 1500, total: 1500, wantOver: true},
		{kept: true, laterEnd: 1500, total: 1505},
		{kept: true, total: 1005},
		{kept: false, total: 1000},
		{kept: true, total: 1000, acked: 1000, wantOver: true, wantUsable: true},
	} {
		m := newAckMark(nil, 1000, flush, 20*time.Microsecond)
		m.lagged = c.kept && !c.split
		if c.laterEnd > 0 {
			m.laterEnd.Store(c.laterEnd)
			m.later.Store(flush.Add(50 * time.Microsecond).UnixNano())
		}
		m.ended(c.acked, c.total, end, 0)
		if m.over != c.wantOver || !m.ackedAt.IsZero() != c.wantUsable {
			t.Errorf("kept %v, split %v, next write to %d, %d at the end, %d acknowledged: over %v, usable %v; want %v, %v",
				c.kept, c.split, c.laterEnd, c.total, c.acked, m.over, !m.ackedAt.IsZero(), c.wantOver, c.wantUsable)
		}
	}
}

// A mark waits as long as its stream's first tokens are unacknowledged:
// its size is a bound on what an open stream holds (192 bytes, its
// allocation's size class).
func TestAckMarkSize(t *testing.T) {
	if size := unsafe.Sizeof(ackMark{}); size > 192 {
		t.Errorf("ackMark is %d bytes, bound 192", size)
	}
}
