package proxy

import (
	"io"
	"net"
	"testing"
	"time"
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
func ackedBase(t *testing.T, s *net.TCPConn) (int64, *tcpInfo) {
	t.Helper()
	sys, _ := s.SyscallConn()
	var ti tcpInfo
	if !ti.read(sys) {
		t.Skip("no TCP_INFO here")
	}
	return int64(ti.info.Bytes_acked), &ti
}

// TestAckMarkSeesTheAcknowledgement: the client's kernel acknowledges the
// bytes at once on loopback; looks 0.1 ms apart see it and it is usable,
// stamped between the look before and the one that saw it. The shared
// watch ends a mark by itself.
func TestAckMarkSeesTheAcknowledgement(t *testing.T) {
	s, c := loopPair(t)
	base, _ := ackedBase(t, s)
	go io.Copy(io.Discard, c)
	sys, _ := s.SyscallConn()
	if _, err := s.Write(make([]byte, 300)); err != nil {
		t.Fatal(err)
	}
	flush := time.Now()
	m := newAckMark(sys, base+300, flush, 50*time.Microsecond)
	var ti tcpInfo
	// The looks' own clock, 0.1 ms a look, whatever the machine's load.
	at := flush
	for !m.look(at, &ti) {
		at = at.Add(100 * time.Microsecond)
		time.Sleep(200 * time.Microsecond)
	}
	got := m.take()
	ok := !got.IsZero()
	if !ok || got.Before(flush) || got.After(at) {
		t.Fatalf("acknowledgement stamped %v, usable %v: want between the write (%v) and the look that saw it (%v)", got, ok, flush, at)
	}

	if _, err := s.Write(make([]byte, 10)); err != nil {
		t.Fatal(err)
	}
	var w lookWatch
	m2 := newAckMark(sys, base+310, time.Now(), 50*time.Microsecond)
	w.add(m2, time.Now)
	waitUntil(t, func() bool { // the watch ends the mark
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
	s, c := loopPair(t)
	base, _ := ackedBase(t, s)
	go io.Copy(io.Discard, c)
	sys, _ := s.SyscallConn()
	if _, err := s.Write(make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	flush := time.Now()
	m := newAckMark(sys, base+100, flush, 100*time.Millisecond)
	var ti tcpInfo
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

	// Later bytes written 10 µs after the token's: once they have had
	// nine tenths of a round trip, no acknowledgement found could count,
	// and the watch ends unusable; before it, it goes on.
	overtaken := newAckMark(sys, base+1000, flush, time.Millisecond)
	overtaken.later.Store(flush.Add(10 * time.Microsecond).UnixNano())
	if overtaken.look(flush.Add(800*time.Microsecond), &ti) {
		t.Fatal("the watch ended before the later bytes could have been acknowledged")
	}
	if !overtaken.look(flush.Add(910*time.Microsecond), &ti) {
		t.Fatal("the watch went on after the later bytes could have been acknowledged")
	}
	if !overtaken.take().IsZero() {
		t.Fatal("an overtaken mark counted as acknowledged")
	}
}
