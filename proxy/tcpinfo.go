package proxy

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tcpInfo reads a socket's TCP_INFO into a buffer of its own, without
// allocating once made: the control function is built at the first read.
// A tcpInfo is used by one goroutine at a time. getsockopt never waits, so
// it is made without the runtime's syscall bookkeeping (see rxConn.recvmsg).
type tcpInfo struct {
	fn   func(fd uintptr)
	ok   bool
	info unix.TCPInfo
}

// read fills t.info from raw's socket and reports whether it could.
func (t *tcpInfo) read(raw syscall.RawConn) bool {
	if raw == nil {
		return false
	}
	if t.fn == nil {
		t.fn = func(fd uintptr) {
			size := uint32(unsafe.Sizeof(t.info))
			_, _, errno := unix.RawSyscall6(unix.SYS_GETSOCKOPT, fd, unix.IPPROTO_TCP, unix.TCP_INFO,
				uintptr(unsafe.Pointer(&t.info)), uintptr(unsafe.Pointer(&size)), 0)
			t.ok = errno == 0
		}
	}
	t.ok = false
	if raw.Control(t.fn) != nil {
		return false
	}
	return t.ok
}
