//go:build !race

package proxy

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// rawWrite writes b to the non-blocking socket fd without the runtime's
// syscall bookkeeping (see rxConn.sendRaw).
func rawWrite(fd uintptr, b []byte) (int, syscall.Errno) {
	n, _, e := unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
	return int(n), e
}
