//go:build !race

package sock

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Write writes b to the non-blocking descriptor fd once, without the
// runtime's syscall bookkeeping (RawSyscall): the call never waits, and
// the bookkeeping's first call after an idle spell wakes the runtime's
// monitor thread (see Conn.sendRaw). EAGAIN and EINTR are the
// caller's to handle.
func Write(fd uintptr, b []byte) (int, syscall.Errno) {
	n, _, e := unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(n), e
}
