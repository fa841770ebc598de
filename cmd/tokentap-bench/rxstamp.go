package main

import (
	"io"
	"net"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// kernelConn reads a TCP connection with recvmsg and keeps the kernel's
// receive time of the last read (SO_TIMESTAMPNS): the moment the bytes
// reached this machine, before the client's own goroutine got to them. The
// accuracy table compares tokentap's figures with that clock as well as
// with the read's: on a busy machine the client's reads come late, and that
// lateness is the client's, not tokentap's.
type kernelConn struct {
	*net.TCPConn
	raw  syscall.RawConn
	fn   func(fd uintptr) bool
	p    []byte
	oob  [64]byte
	n    int
	err  error
	last int64 // Unix ns of the last read's bytes; 0: none
}

// stampConn returns nc reading with kernel receive times, or nc itself
// when they cannot be had.
func stampConn(nc net.Conn) net.Conn {
	tc, ok := nc.(*net.TCPConn)
	if !ok {
		return nc
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return nc
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TIMESTAMPNS, 1)
	}); err != nil || serr != nil {
		return nc
	}
	k := &kernelConn{TCPConn: tc, raw: raw}
	k.fn = k.recv
	return k
}

func (k *kernelConn) recv(fd uintptr) bool {
	n, oobn, _, _, err := unix.Recvmsg(int(fd), k.p, k.oob[:], 0)
	if err == unix.EAGAIN {
		return false // wait for readability
	}
	k.n, k.err = n, err
	if err == nil && n > 0 {
		if ts := kernelStamp(k.oob[:oobn]); ts != 0 {
			k.last = ts
		}
	}
	return true
}

func (k *kernelConn) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	k.p = b
	err := k.raw.Read(k.fn)
	k.p = nil
	switch {
	case err != nil:
		return 0, err // a deadline or a closed connection
	case k.err != nil:
		return 0, k.err
	case k.n == 0:
		return 0, io.EOF
	}
	return k.n, nil
}

// kernelStamp finds SCM_TIMESTAMPNS among control messages, or returns 0.
// (x/sys parses them, a small allocation per read: the client is not on
// the path it measures.)
func kernelStamp(oob []byte) int64 {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return 0
	}
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SCM_TIMESTAMPNS && len(m.Data) >= int(unsafe.Sizeof(unix.Timespec{})) {
			return (*unix.Timespec)(unsafe.Pointer(&m.Data[0])).Nano()
		}
	}
	return 0
}

// receivedAt returns when the kernel received the bytes of c's last read,
// or now when c carries no stamps (or the stamp is not within a minute
// before now).
func receivedAt(c net.Conn, now time.Time) time.Time {
	k, ok := c.(*kernelConn)
	if !ok || k.last == 0 {
		return now
	}
	d := time.Duration(now.UnixNano() - k.last)
	if d < 0 || d > time.Minute {
		return now
	}
	return now.Add(-d)
}
