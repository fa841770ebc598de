package sock

import (
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
	"unsafe"

	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"golang.org/x/sys/unix"
)

// tcpPair returns a connected client and the accepted side wrapped in Conn.
func tcpPair(t testing.TB) (client net.Conn, server *Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if raw, err := ln.(*net.TCPListener).SyscallConn(); err != nil || EnableRxStamps(raw) != nil {
		t.Fatal("receive timestamps could not be enabled")
	}
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	sc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); sc.Close() })
	return client, NewConn(sc.(*net.TCPConn), true)
}

// stampsOn holds a stamped socket open for the rest of the test and waits
// until the kernel stamps what it receives: the first socket to ask turns a
// global switch on asynchronously, and closing the last turns it off, so
// tests that open and close listeners would otherwise race it. (A
// long-running tokentap keeps its listener, and the switch, on.)
func stampsOn(t testing.TB) {
	t.Helper()
	client, c := tcpPair(t)
	buf := make([]byte, 8)
	wait.For(t, func() error {
		client.Write([]byte("x"))
		if _, err := c.Read(buf); err != nil {
			t.Fatal(err)
		}
		if c.timestamp() == 0 { // the read's fallback, not the kernel's stamp
			return errors.New("the kernel does not stamp received packets")
		}
		return nil
	})
}

// Bytes that waited in the socket are stamped with their arrival, not with
// the read; reads behave like net.Conn's (EOF, deadlines) and allocate
// nothing.
func TestRxConnReceiveTime(t *testing.T) {
	stampsOn(t)
	client, c := tcpPair(t)
	sent := time.Now()
	io.WriteString(client, "hello")
	const wait = 60 * time.Millisecond
	time.Sleep(wait)
	buf := make([]byte, 64)
	n, err := c.Read(buf)
	now := time.Now()
	if err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	at := Received(c.rx, now, time.Minute)
	if waited := now.Sub(at); waited < wait-5*time.Millisecond || at.Before(sent.Add(-time.Millisecond)) {
		t.Fatalf("received %v before the read, sent %v before it: want ≈ %v", waited, now.Sub(sent), wait)
	}

	one := []byte("x")
	if a := testing.AllocsPerRun(200, func() {
		client.Write(one)
		if n, err := c.Read(buf); n != 1 || err != nil {
			t.Fatalf("read %d, %v", n, err)
		}
	}); a != 0 {
		t.Errorf("allocs per read = %v, want 0", a)
	}

	c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, err = c.Read(buf)
	var ne net.Error
	if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("read past deadline: %v, want a timeout", err)
	}
	c.SetReadDeadline(time.Time{})

	client.Close()
	if n, err := c.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("read after close: %d, %v, want io.EOF", n, err)
	}
}

// A stamp that is absent, in the future or too old falls back to now, on
// now's monotonic clock.
func TestReceivedBounds(t *testing.T) {
	now := time.Now()
	for _, rx := range []int64{0, now.Add(time.Second).UnixNano(), now.Add(-2 * time.Minute).UnixNano()} {
		if got := Received(rx, now, time.Minute); got != now {
			t.Errorf("Received(%d) = %v, want now", rx, got)
		}
	}
	got := Received(now.Add(-3*time.Millisecond).UnixNano(), now, time.Minute)
	if d := now.Sub(got); d != 3*time.Millisecond {
		t.Errorf("received 3ms ago: %v", d)
	}
}

// BenchmarkSocketRead compares a stamped read (recvmsg with the receive
// timestamp) with a plain one, 200-byte events on loopback.
func BenchmarkSocketRead(b *testing.B) {
	for _, stamped := range []bool{false, true} {
		name := "plain"
		if stamped {
			name = "stamped"
		}
		b.Run(name, func(b *testing.B) {
			stampsOn(b)
			client, c := tcpPair(b)
			if !stamped {
				c.Unstamped()
			}
			ev := make([]byte, 200)
			buf := make([]byte, 4096)
			b.ReportAllocs()
			for b.Loop() {
				client.Write(ev)
				for n := 0; n < len(ev); {
					m, err := c.Read(buf)
					if err != nil {
						b.Fatal(err)
					}
					n += m
				}
			}
		})
	}
}

// The control-message reader never reads past what the kernel filled in,
// whatever the bytes, and finds a well-formed SCM_TIMESTAMPNS wherever it
// sits among other messages.
func FuzzRxTimestamp(f *testing.F) {
	f.Add([]byte{}, uint8(0), int64(0), int64(0))
	f.Add(make([]byte, 40), uint8(16), int64(1795973035), int64(108205099))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, uint8(0), int64(1), int64(2))
	f.Fuzz(func(t *testing.T, raw []byte, prefix uint8, sec, nsec int64) {
		var c Conn
		oob := unsafe.Slice((*byte)(unsafe.Pointer(&c.oob[0])), len(c.oob)*8)
		// Arbitrary bytes, with an arbitrary filled length.
		n := copy(oob, raw)
		c.msg.SetControllen(n)
		_ = c.timestamp()
		c.msg.SetControllen(len(raw)) // may claim more than the buffer
		_ = c.timestamp()

		// A well-formed timestamp after an aligned filler message.
		clear(oob)
		off := 0
		if p := int(prefix) % 3; p > 0 {
			h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
			h.Level, h.Type = unix.SOL_SOCKET, 99
			h.SetLen(unix.CmsgLen(p * 4))
			off = unix.CmsgSpace(p * 4)
		}
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[off]))
		h.Level, h.Type = unix.SOL_SOCKET, unix.SCM_TIMESTAMPNS
		ts := unix.Timespec{Sec: sec, Nsec: nsec}
		h.SetLen(unix.CmsgLen(int(unsafe.Sizeof(ts))))
		*(*unix.Timespec)(unsafe.Pointer(&oob[off+unix.CmsgLen(0)])) = ts
		c.msg.SetControllen(off + unix.CmsgSpace(int(unsafe.Sizeof(ts))))
		if got := c.timestamp(); got != ts.Nano() {
			t.Fatalf("timestamp %d, want %d", got, ts.Nano())
		}
	})
}

// TestRxConnWrite: the raw write delivers every byte in order through a
// full socket buffer (the peer reads slowly), stops at a deadline with the
// count written so far, and reports a peer's reset as a write error.
func TestRxConnWrite(t *testing.T) {
	client, c := tcpPair(t)
	if c.raw == nil {
		t.Fatal("the connection has no raw access: the raw write is not under test")
	}
	want := make([]byte, 8<<20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	got := make(chan []byte)
	go func() {
		var b []byte
		buf := make([]byte, 4096)
		for len(b) < len(want) {
			n, err := client.Read(buf)
			b = append(b, buf[:n]...)
			if err != nil {
				break
			}
			if len(b) < 1<<20 {
				time.Sleep(time.Millisecond) // slow at first: the writer meets a full buffer
			}
		}
		got <- b
	}()
	n, err := c.Write(want)
	if err != nil || n != len(want) {
		t.Fatalf("Write = %d, %v; want %d, nil", n, err, len(want))
	}
	if b := <-got; string(b) != string(want) {
		t.Fatalf("the peer received %d bytes, not the %d written in order", len(b), len(want))
	}

	// Nobody reads: the deadline ends the write, with what was written.
	c.SetWriteDeadline(time.Now().Add(50 * time.Millisecond))
	n, err = c.Write(want)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || n <= 0 || n >= len(want) {
		t.Fatalf("Write past a deadline = %d, %v; want a timeout after some bytes", n, err)
	}
	if oe, ok := err.(*net.OpError); !ok || oe.Op != "write" {
		t.Fatalf("error %#v is not a write OpError", err)
	}

	// The peer resets: the next writes fail with a syscall error.
	c.SetWriteDeadline(time.Time{})
	client.(*net.TCPConn).SetLinger(0)
	client.Close()
	wait.For(t, func() error { // writes to a reset connection stop succeeding
		if _, err = c.Write([]byte("x")); err == nil {
			return errors.New("writes to a reset peer still succeed")
		}
		return nil
	})
	var se *os.SyscallError
	if !errors.As(err, &se) || se.Syscall != "write" {
		t.Fatalf("write to a reset peer: %v, want a write syscall error", err)
	}
}
