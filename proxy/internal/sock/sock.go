// Package sock is the socket calls of the relay made without the
// runtime's syscall bookkeeping: reads that carry the kernel's receive
// time (Conn), TCP_INFO (TCPInfo), a non-consuming look at a peer (Peek,
// HungUp), raw writes (Write) and a shutdown that leaves the descriptor
// open (Shutdown). Each call never waits: the sockets are non-blocking.
package sock

import (
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// PeerState is what one non-consuming look at a socket found.
type PeerState int

const (
	PeerIdle    PeerState = iota // open, nothing to read
	PeerData                     // bytes are waiting (a pipelined request, or a stale response)
	PeerClosed                   // the peer closed or reset the connection
	PeerUnknown                  // not a socket we can look at
)

// Peek looks at fd without consuming anything: recv(MSG_PEEK|MSG_DONTWAIT)
// of one byte, again when a signal interrupted it. It does not allocate,
// and the call, which never waits, is made without the runtime's syscall
// bookkeeping (RawSyscall6): that cost more than the look.
func Peek(fd uintptr) PeerState {
	var b [1]byte
	for {
		n, _, errno := unix.RawSyscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1,
			unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
		switch {
		case errno == unix.EINTR:
		case errno == unix.EAGAIN:
			return PeerIdle
		case errno != 0 || n == 0:
			return PeerClosed
		default:
			return PeerData
		}
	}
}

// HungUp reports a peer that shut its side of the connection down (or
// reset it), whatever bytes it sent before.
//
// The call (ppoll with a zero timeout) never waits and is made without the
// runtime's syscall bookkeeping, as Peek's.
func HungUp(fd uintptr) bool {
	fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	var now unix.Timespec
	for {
		n, _, e := unix.RawSyscall6(unix.SYS_PPOLL, uintptr(unsafe.Pointer(&fds[0])), 1,
			uintptr(unsafe.Pointer(&now)), 0, 0, 0)
		switch {
		case e == unix.EINTR:
		case e != 0 || n == 0:
			return false
		default:
			return fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
		}
	}
}

// Controller runs a function with a socket's descriptor (as
// syscall.RawConn does); an error when the socket is closed.
type Controller interface {
	Control(f func(fd uintptr)) error
}

// Fd returns the descriptor behind c, or -1. For a stream, only its own
// goroutine calls it, and the descriptor stays open while the stream is in
// a loop (see Loop).
func Fd(c Controller) int {
	fd := -1
	if c.Control(func(f uintptr) { fd = int(f) }) != nil {
		return -1
	}
	return fd
}

// Raw returns conn's descriptor access, or nil when conn is not backed by
// a socket. A connection that keeps its own (Raw() syscall.RawConn: a
// Conn, or a connection over one) gives it without allocating.
func Raw(conn net.Conn) syscall.RawConn {
	if c, ok := conn.(interface{ Raw() syscall.RawConn }); ok {
		if raw := c.Raw(); raw != nil {
			return raw
		}
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return raw
}

// Shutdown shuts conn's socket down in both directions, which ends a
// relay loop's stream on it as a close would, while the descriptor stays
// open for the loop that holds it.
func Shutdown(conn net.Conn) {
	if raw := Raw(conn); raw != nil {
		_ = raw.Control(func(fd uintptr) { _ = unix.Shutdown(int(fd), unix.SHUT_RDWR) })
	}
}

// IsTimeout reports a deadline error, including fasthttp's ErrTimeout,
// which is not a full net.Error.
func IsTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout() || errors.Is(err, os.ErrDeadlineExceeded)
}

// IsConnReset reports errors that mean the peer closed the connection.
func IsConnReset(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed)
}
