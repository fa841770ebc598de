package relayplane

import (
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
// of one byte, again when a signal interrupted it. It does not allocate.
func Peek(fd uintptr) PeerState {
	var b [1]byte
	for {
		n, _, errno := unix.Syscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1,
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
func HungUp(fd uintptr) bool {
	fds := [1]unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(fds[:], 0)
	return err == nil && n > 0 && fds[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
}

// Fd returns the descriptor behind raw, or -1. Only a stream's own
// goroutine calls it, and the descriptor stays open while the stream is in
// a loop (see Loop).
func Fd(raw syscall.RawConn) int {
	fd := -1
	if raw.Control(func(f uintptr) { fd = int(f) }) != nil {
		return -1
	}
	return fd
}

// Spares keeps up to its capacity of values for reuse by any goroutine;
// more are left to the collector. Unlike a sync.Pool, which keeps every
// value put until two collections have passed, it does not hold what a
// crowd of open streams let go of: their memory is free again at once,
// and a burst of new streams reuses the values of those that came before.
type Spares[T any] chan T

// Get returns a kept value, if one is.
func (s Spares[T]) Get() (v T, ok bool) {
	select {
	case v = <-s:
		return v, true
	default:
		return v, false
	}
}

// Put keeps v, unless the store is full.
func (s Spares[T]) Put(v T) {
	select {
	case s <- v:
	default:
	}
}

// The relay's read buffers, let go of between a looped stream's events
// (spareBufs) and at a stream's end.
var spareBufsAll = make(Spares[[]byte], 128)

// BufSize is the size of a relay's read buffer.
const BufSize = 8 << 10

// NewBuf returns a kept read buffer, or a new one.
func NewBuf() []byte {
	if b, ok := spareBufsAll.Get(); ok {
		return b
	}
	return make([]byte, BufSize)
}

// PutBuf keeps b for another stream.
func PutBuf(b []byte) {
	if cap(b) >= BufSize {
		spareBufsAll.Put(b[:BufSize])
	}
}
