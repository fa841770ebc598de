package downstream

import (
	"sync/atomic"
	"syscall"
	"time"
)

// monitorEvery is the longest the runtime's monitor thread sleeps while
// requests are in flight.
const monitorEvery = 50 * time.Millisecond

// MonitorTick keeps the Go runtime's monitor thread (sysmon) within
// monitorEvery of its rounds while requests are in flight.
//
// The monitor preempts a goroutine that has run for 10 ms and polls the
// network when no processor has for 10 ms. While every processor is idle
// it sleeps until the next timer is due (at most a minute), and only a
// system call made through the runtime's bookkeeping wakes it earlier.
// tokentap's socket calls skip that bookkeeping (sock.Conn.recvmsg, sendRaw:
// it cost more than the calls), so a request that arrives after an idle
// spell and runs long on the processor (a large body's parse, a decode)
// would not be preempted: measured with one processor, a goroutine woken
// by a raw read and spinning for 300 ms held off another ready one for
// all of it. The ticks bound that sleep: arm, as a request begins, wakes
// the monitor when the ticks were off (one getpid through the
// bookkeeping), and a timer every monitorEvery, while anything is in
// flight, ends its sleeps from then on: a long request is preempted within
// about 60 ms (the tick, then the monitor's 10 ms). A tick that finds the
// process idle wakes a thread and the monitor: on a 2-core VM about 75 µs
// and 4 context switches, 1.5 ms of CPU a second while anything is in
// flight (20 ms ticks cost 2.5 times that for a bound 30 ms shorter).
type MonitorTick struct {
	armed atomic.Bool
	timer *time.Timer
	busy  func() bool // requests are in flight
}

func NewMonitorTick(busy func() bool) *MonitorTick {
	m := &MonitorTick{busy: busy}
	m.timer = time.AfterFunc(time.Hour, m.tick)
	m.timer.Stop()
	return m
}

// Arm starts the ticks unless they run. The monitor's sleep was set by the
// timers pending when it began, and a new timer does not shorten it: the
// getpid, made through the bookkeeping, wakes it.
func (m *MonitorTick) Arm() {
	if m.armed.Load() || !m.armed.CompareAndSwap(false, true) {
		return
	}
	_, _, _ = syscall.Syscall(syscall.SYS_GETPID, 0, 0, 0)
	m.timer.Reset(monitorEvery)
}

// tick runs every monitorEvery while armed; with nothing in flight the
// ticks stop, and a request that began meanwhile starts them again.
func (m *MonitorTick) tick() {
	if m.busy() {
		m.timer.Reset(monitorEvery)
		return
	}
	m.armed.Store(false)
	if m.busy() {
		m.Arm()
	}
}
