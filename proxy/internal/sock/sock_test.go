package sock

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// rawPair returns a loopback TCP connection's two ends: ours, whose
// descriptor the looks are given, and the peer's.
func rawPair(t *testing.T) (ours *net.TCPConn, peer *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	d, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close(); a.Close() })
	return a.(*net.TCPConn), d.(*net.TCPConn)
}

// eventually looks at fd until look answers want, for up to 10 s, waiting
// between looks for the socket to change (poll): the peer's bytes and its
// FIN reach our socket a moment after its calls return.
func eventually[T comparable](t *testing.T, fd uintptr, what string, want T, look func() T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := look()
		if got == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v, want %v", what, got, want)
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
		_, _ = unix.Poll(fds, 10)
	}
}

// The peer's states as Peek and HungUp read them from the socket: idle,
// bytes waiting (not a hang-up), shut down for writing with bytes still
// unread (a hang-up, the bytes still there), and reset.
func TestPeekAndHungUp(t *testing.T) {
	ours, peer := rawPair(t)
	fd := uintptr(Fd(mustRaw(t, ours)))
	if Peek(fd) != PeerIdle || HungUp(fd) {
		t.Fatalf("an open, quiet connection: Peek %v, HungUp %v", Peek(fd), HungUp(fd))
	}
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	eventually(t, fd, "Peek after the peer wrote", PeerData, func() PeerState { return Peek(fd) })
	if HungUp(fd) {
		t.Fatal("bytes waiting were read as a hang-up")
	}
	if err := peer.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	eventually(t, fd, "HungUp after the peer shut its side", true, func() bool { return HungUp(fd) })
	if Peek(fd) != PeerData {
		t.Fatal("the peer's byte sent before its shutdown is gone")
	}

	ours2, peer2 := rawPair(t)
	fd2 := uintptr(Fd(mustRaw(t, ours2)))
	if err := peer2.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	peer2.Close() // a reset
	eventually(t, fd2, "HungUp after the peer's reset", true, func() bool { return HungUp(fd2) })
	if Peek(fd2) != PeerClosed {
		t.Fatalf("Peek after the peer's reset: %v, want PeerClosed", Peek(fd2))
	}
}

func mustRaw(t *testing.T, c *net.TCPConn) Controller {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return raw
}
