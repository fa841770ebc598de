package sock

import (
	"io"
	"net"
	"os"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Conn is a TCP connection whose reads report when the kernel received
// the bytes (SO_TIMESTAMPNS), not when tokentap got around to reading them.
//
// Under load a request or an event can sit in the socket while the
// goroutine that will read it waits for a CPU; stamps taken after the read
// hide that wait from every figure tokentap records, and it is time the
// gateway added. Reads go through recvmsg with a control buffer held by the
// connection, so they allocate nothing; a connection whose timestamps
// cannot be enabled reads as usual and reports none.
type Conn struct {
	*net.TCPConn
	raw  syscall.RawConn // nil: timestamps off, plain reads
	msg  unix.Msghdr
	iov  unix.Iovec
	oob  [8]uint64 // control messages, 8-byte aligned
	recv func(fd uintptr) bool
	send func(fd uintptr) bool

	wb   []byte // the bytes send has yet to write, and how many it wrote
	wn   int
	werr syscall.Errno

	n     int
	errno syscall.Errno
	rx    int64 // kernel receive time of the last read, Unix ns; 0: none
}

// EnableRxStamps asks the kernel to stamp what the socket receives. Set on
// a listening socket, it is inherited by every accepted one, stamps
// included for the bytes that arrive before accept returns; set before
// connect (net.Dialer.Control), it covers a dialled one from its first byte.
// The kernel turns stamping on for the whole host asynchronously when the
// first socket asks for it: packets received in that first moment carry no
// stamp, and their reads fall back to the time the read returned.
func EnableRxStamps(raw syscall.RawConn) error {
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TIMESTAMPNS, 1)
	}); err != nil {
		return err
	}
	return serr
}

// LimitUnsent has the kernel take a write on the socket only while fewer
// than n bytes written wait unsent (TCP_NOTSENT_LOWAT): bytes a client
// cannot take yet (its receive window is full, its path is congested) then
// hold the write back instead of queueing in the socket's buffer, which may
// hold megabytes, so the time a client held a response shows as its
// writes' wait, and the delivery of each token is stamped within n bytes
// of when it could leave.
func LimitUnsent(raw syscall.RawConn, n int) error {
	var serr error
	if err := raw.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, n)
	}); err != nil {
		return err
	}
	return serr
}

// NewConn wraps tc, whose socket has receive timestamps enabled
// (EnableRxStamps) when stamped is true.
func NewConn(tc *net.TCPConn, stamped bool) *Conn {
	c := &Conn{TCPConn: tc}
	if !stamped {
		return c
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	c.raw = raw
	c.msg.Iov = &c.iov
	c.msg.SetIovlen(1)
	c.recv = c.recvmsg
	c.send = c.sendRaw
	return c
}

// Raw returns the connection's descriptor access, or nil (timestamps off).
func (c *Conn) Raw() syscall.RawConn { return c.raw }

// Rx is when the kernel received the bytes of the last read, Unix ns (0:
// none yet).
func (c *Conn) Rx() int64 { return c.rx }

// KernelStamped reports whether the last read's bytes carried the
// kernel's stamp (not the read's own time: host-wide stamping still being
// switched on, or timestamps off).
func (c *Conn) KernelStamped() bool { return c.raw != nil && c.timestamp() != 0 }

// Unstamped turns c's stamped reads and raw writes off: it reads and
// writes as a plain net.TCPConn (a baseline to compare against).
func (c *Conn) Unstamped() { c.raw = nil }

// recvmsg is the read done when the socket is readable; false asks the
// runtime to wait for readability and call it again. The call never waits
// (the socket is non-blocking), so it is made without the runtime's
// syscall bookkeeping (RawSyscall): a read copies what is already queued
// and does not run the sender's side of TCP, so the reason writes keep the
// bookkeeping (sendRaw) does not hold for it, and the bookkeeping cost a
// read more than the read: the processor's hand-off state both ways, and
// the runtime's monitor thread woken from its sleep by a read that began a
// burst of work, then polling every 20 µs while the burst ran. Side by side
// at 1,000 requests/s that was 3.8 µs a request (median of 7 rounds) and
// 3-14 µs a one-token stream.
func (c *Conn) recvmsg(fd uintptr) bool {
	for {
		c.msg.Control = (*byte)(unsafe.Pointer(&c.oob[0]))
		c.msg.SetControllen(len(c.oob) * 8)
		n, _, e := unix.RawSyscall(unix.SYS_RECVMSG, fd, uintptr(unsafe.Pointer(&c.msg)), unix.MSG_CMSG_CLOEXEC)
		switch e {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		}
		c.n, c.errno = int(n), e
		if e == 0 && n > 0 {
			// Bytes the kernel did not stamp (host-wide stamping still
			// being switched on) are stamped with the time of the read.
			if c.rx = c.timestamp(); c.rx == 0 {
				c.rx = time.Now().UnixNano()
			}
		}
		return true
	}
}

// RecvFd reads into b from fd, c's socket as a relay loop holds it, as
// Read does but without the runtime's poller: EAGAIN when nothing is
// waiting. The receive time is left in c.rx.
func (c *Conn) RecvFd(fd uintptr, b []byte) (int, syscall.Errno) {
	c.iov.Base = &b[0]
	c.iov.SetLen(len(b))
	read := c.recvmsg(fd)
	c.iov.Base = nil
	switch {
	case !read:
		return 0, unix.EAGAIN
	case c.errno != 0:
		return 0, c.errno
	}
	return c.n, 0
}

// timestamp finds SCM_TIMESTAMPNS among the control messages of the last
// recvmsg, or returns 0.
func (c *Conn) timestamp() int64 {
	oob := unsafe.Slice((*byte)(unsafe.Pointer(&c.oob[0])), len(c.oob)*8)
	oob = oob[:min(int(c.msg.Controllen), len(oob))]
	for len(oob) >= unix.SizeofCmsghdr {
		h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
		l := int(h.Len)
		if l < unix.SizeofCmsghdr || l > len(oob) {
			return 0
		}
		if h.Level == unix.SOL_SOCKET && h.Type == unix.SCM_TIMESTAMPNS && l >= unix.CmsgLen(int(unsafe.Sizeof(unix.Timespec{}))) {
			ts := (*unix.Timespec)(unsafe.Pointer(&oob[unix.CmsgLen(0)]))
			return ts.Nano()
		}
		oob = oob[min(unix.CmsgSpace(l-unix.CmsgLen(0)), len(oob)):]
	}
	return 0
}

func (c *Conn) Read(b []byte) (int, error) {
	if c.raw == nil || len(b) == 0 {
		return c.TCPConn.Read(b)
	}
	c.iov.Base = &b[0]
	c.iov.SetLen(len(b))
	err := c.raw.Read(c.recv) // recvmsg sets n and errno whenever it ends the read
	c.iov.Base = nil          // do not keep the caller's buffer alive
	switch {
	case err != nil:
		// A deadline or a closed connection, as net.Conn reports them.
		if oe, ok := err.(*net.OpError); ok {
			oe.Op = "read"
		}
		return 0, err
	case c.errno != 0:
		return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(),
			Err: os.NewSyscallError("recvmsg", c.errno)}
	case c.n == 0:
		return 0, io.EOF
	}
	return c.n, nil
}

// received returns when the kernel received the bytes of the last read, on
// now's clock (so that durations against other stamps stay monotonic). It
// returns now when there is no timestamp or it is not within maxAge before
// now (a stepped wall clock, or a clock other than the system's).
func Received(rx int64, now time.Time, maxAge time.Duration) time.Time {
	if rx == 0 {
		return now
	}
	d := time.Duration(now.UnixNano() - rx)
	if d <= 0 || d > maxAge {
		return now
	}
	return now.Add(-d)
}

// WriteTo hides TCPConn's, which would read the socket without Read.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	return io.Copy(w, struct{ io.Reader }{c})
}

// sendRaw is the write done when the socket is writable: it writes until
// wb is empty, and returns false (wait for writability, call again) when
// the socket buffer is full.
//
// It calls the kernel without telling the runtime (RawSyscall), as the
// reads do (recvmsg): on a non-blocking socket the call never waits. The
// runtime's bookkeeping cost more than the write. Its monitor thread
// (sysmon) sleeps while every processor is idle and is woken by the first
// system call made through the bookkeeping, then polls every 20 µs until
// the processors are idle again; between a gateway's requests they are,
// so each request woke it, with a futex call, its sleeps and a context
// switch each time. At 1,000 non-streamed requests/s on one processor the
// writes were the last calls that woke it: made raw, context switches per
// request fell from 4.6 to 2.1, the monitor's sleeps from 1.3 to 0.1, and
// CPU per request by 16–28% (3 rounds side by side). A write on loopback,
// which also runs the receiver's side of TCP, often takes longer than the
// 20 µs after which the runtime would hand the processor to another
// thread: without the hand-off the write's time is the processor's, as a
// busy proxy's is. Under the race detector the write goes through
// syscall.Write (Write), whose annotations order it before the
// peer's read.
func (c *Conn) sendRaw(fd uintptr) bool {
	for len(c.wb) > 0 {
		n, e := Write(fd, c.wb)
		switch e {
		case 0:
			c.wn += n
			c.wb = c.wb[n:]
		case unix.EINTR:
		case unix.EAGAIN:
			return false
		default:
			c.werr = e
			return true
		}
	}
	return true
}

// Write writes b whole, or stops at an error (a deadline, a closed or reset
// connection) and reports how much was written, as net.Conn does.
func (c *Conn) Write(b []byte) (int, error) {
	if c.raw == nil || len(b) == 0 {
		return c.TCPConn.Write(b)
	}
	c.wb, c.wn, c.werr = b, 0, 0
	err := c.raw.Write(c.send)
	n := c.wn
	c.wb = nil // do not keep the caller's buffer alive
	switch {
	case err != nil:
		if oe, ok := err.(*net.OpError); ok {
			oe.Op = "write"
		}
	case c.werr != 0:
		err = &net.OpError{Op: "write", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError("write", c.werr)}
	}
	return n, err
}
