package sock

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TCPInfo reads a socket's TCP_INFO into a buffer of its own, without
// allocating once made: the control function is built at the first read.
// A TCPInfo is used by one goroutine at a time. getsockopt never waits, so
// it is made without the runtime's syscall bookkeeping (see Conn.recvmsg).
type TCPInfo struct {
	fn   func(fd uintptr)
	ok   bool
	Info unix.TCPInfo
}

// Read fills t.Info from raw's socket and reports whether it could.
func (t *TCPInfo) Read(raw syscall.RawConn) bool {
	if raw == nil {
		return false
	}
	if t.fn == nil {
		t.fn = func(fd uintptr) {
			size := uint32(unsafe.Sizeof(t.Info))
			_, _, errno := unix.RawSyscall6(unix.SYS_GETSOCKOPT, fd, unix.IPPROTO_TCP, unix.TCP_INFO,
				uintptr(unsafe.Pointer(&t.Info)), uintptr(unsafe.Pointer(&size)), 0)
			t.ok = errno == 0
		}
	}
	t.ok = false
	if raw.Control(t.fn) != nil {
		return false
	}
	return t.ok
}
