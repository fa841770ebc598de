package relayplane

import (
	"syscall"
	"unsafe"

	"github.com/tokentap/tokentap/metrics"
	"golang.org/x/sys/unix"
)

// poller is one epoll set, level-triggered: what a relay loop waits on.
// It knows descriptors and slots, never streams; every change it is asked
// for returns its error, counted by operation
// (tokentap_relay_loop_errors_total), for the loop to act on.
type poller struct {
	fd int
}

// Which socket of a stream an event is about (EpollEvent.Pad).
const (
	sideUp     int32 = 0
	sideClient int32 = 1
	sideWatch  int32 = 2 // a client socket watched for its peer's close (Loop.Watch)
)

func newPoller() (*poller, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		metrics.RelayLoopError("create")
		return nil, err
	}
	return &poller{fd: fd}, nil
}

// add watches fd for events, reported with slot and side.
func (p *poller) add(fd int, events uint32, slot, side int32) error {
	return p.ctl("add", unix.EPOLL_CTL_ADD, fd, events, slot, side)
}

// modify changes what fd is watched for.
func (p *poller) modify(fd int, events uint32, slot, side int32) error {
	return p.ctl("modify", unix.EPOLL_CTL_MOD, fd, events, slot, side)
}

// remove stops watching fd.
func (p *poller) remove(fd int) error {
	return p.ctl("remove", unix.EPOLL_CTL_DEL, fd, 0, 0, 0)
}

// ctl is made without the runtime's syscall bookkeeping (RawSyscall6), as
// every call a stream's start and end make: epoll_ctl never waits, and the
// bookkeeping's first call after an idle spell wakes the runtime's monitor
// thread (see sock.Conn.sendRaw).
func (p *poller) ctl(op string, code, fd int, events uint32, slot, side int32) error {
	ev := unix.EpollEvent{Events: events, Fd: slot, Pad: side}
	_, _, e := unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(p.fd), uintptr(code), uintptr(fd),
		uintptr(unsafe.Pointer(&ev)), 0, 0)
	if e != 0 {
		metrics.RelayLoopError(op)
		return e
	}
	return nil
}

// wait takes the ready events without blocking (the loop parks in the
// runtime's poller on the epoll descriptor instead); it retries on EINTR.
func (p *poller) wait(events []unix.EpollEvent) (int, syscall.Errno) {
	for {
		n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(p.fd), uintptr(unsafe.Pointer(&events[0])),
			uintptr(len(events)), 0, 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			metrics.RelayLoopError("wait")
		}
		return int(n), e
	}
}
