//go:build linux

package downstream

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"golang.org/x/sys/unix"
)

// TestMain lets this test binary serve as TestMonitorTickPreemptsLongWork's
// client, a process of its own.
func TestMain(m *testing.M) {
	serveMonitorClient()
	os.Exit(m.Run())
}

// envMonitorClient makes this test binary the far side of
// TestMonitorTickPreemptsLongWork: a process of its own, so that its
// writes wake nothing in the test's.
const envMonitorClient = "TOKENTAP_TEST_MONITOR_CLIENT"

// serveMonitorClient, in the child, connects twice to the address in
// envMonitorClient, and waits for the parent's word on the second
// connection that it is set: then it writes a byte on the first, waits for
// the parent's word on the first that its long request began, writes a
// byte on the second, and waits for the parent to close the first.
func serveMonitorClient() {
	addr := os.Getenv(envMonitorClient)
	if addr == "" {
		return
	}
	a, err := net.Dial("tcp", addr)
	if err != nil {
		os.Exit(2)
	}
	b, err := net.Dial("tcp", addr)
	if err != nil {
		os.Exit(2)
	}
	_ = a.SetDeadline(time.Now().Add(30 * time.Second))
	_ = b.SetDeadline(time.Now().Add(30 * time.Second))
	word := make([]byte, 1)
	read := func(c net.Conn) {
		if _, err := c.Read(word); err != nil {
			os.Exit(2)
		}
	}
	write := func(c net.Conn, say string) {
		if _, err := c.Write([]byte(say)); err != nil {
			os.Exit(2)
		}
	}
	read(b) // the parent is set
	waitMonitorAsleep(os.Getppid())
	write(a, "a") // the long request's byte
	read(a)       // it began
	write(b, "b") // the other request's byte
	_, _ = a.Read(word)
	os.Exit(0)
}

// waitMonitorAsleep waits, for up to 10 s, until every thread of process
// pid sleeps in a system call other than nanosleep: its runtime's monitor
// has left its rounds (which sleep in nanosleep) for its deep sleep.
func waitMonitorAsleep(pid int) {
	asleep := func() bool {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return false
		}
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/syscall", pid, task.Name()))
			if err != nil {
				return false
			}
			f := strings.Fields(string(b))
			if len(f) == 0 {
				return false
			}
			nr, err := strconv.Atoi(f[0]) // "running" when it is not in one
			if err != nil || nr == unix.SYS_NANOSLEEP || nr == unix.SYS_CLOCK_NANOSLEEP {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(10 * time.Second); !asleep() && time.Now().Before(deadline); {
		runtime.Gosched()
	}
}

// On one processor, a request that begins after an idle moment and keeps
// the processor for a second (its reads skip the runtime's bookkeeping, as
// tokentap's do) is preempted, and another connection's request, ready
// once it began, runs long before the second is out: the runtime's monitor
// is awake. "first" arms as the long request begins (arm's wake-up);
// "earlier" arms before, as while another request is in flight, so that
// the pending tick ends the monitor's sleep. Without arm the other request
// waits for the whole second: the monitor sleeps through it. The ticks'
// rhythm is TestMonitorTickTicksWhileBusy's.
func TestMonitorTickPreemptsLongWork(t *testing.T) {
	wait.Long(t, "a second of spinning, twice")
	for _, early := range []bool{false, true} {
		name := map[bool]string{false: "first", true: "earlier"}[early]
		t.Run(name, func(t *testing.T) {
			if wait := longWorkDelay(t, early); wait > 300*time.Millisecond {
				t.Fatalf("the other request ran %v after the long one began: not preempted", wait)
			}
		})
	}
}

// longWorkDelay runs the scene above on one processor and returns how long
// after the long request began the other one ran.
func longWorkDelay(t *testing.T, early bool) time.Duration {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), envMonitorClient+"="+ln.Addr().String())
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = child.Wait() }()
	accept := func() *sock.Conn {
		c, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		rc := sock.NewConn(c.(*net.TCPConn), true)
		if rc.Raw() == nil {
			t.Fatal("no raw access: the raw read is not under test")
		}
		return rc
	}
	ca, cb := accept(), accept()
	defer ca.Close()
	defer cb.Close()

	var inFlight atomic.Bool
	m := NewMonitorTick(inFlight.Load)
	if early {
		inFlight.Store(true)
		m.Arm()
	}
	spinning := make(chan time.Time, 1)
	otherRan := make(chan time.Time, 1)
	var stop atomic.Bool // the long request ends when the scene does
	spun := make(chan struct{})
	defer func() { stop.Store(true); <-spun }()
	go func() {
		defer close(spun)
		if _, err := ca.Read(make([]byte, 1)); err != nil {
			spinning <- time.Time{}
			return
		}
		inFlight.Store(true)
		m.Arm() // as Proxy.begin does
		start := time.Now()
		spinning <- start
		// The child's cue for the other request. The raw write (sendRaw)
		// wakes nothing here, as the read did not.
		if _, err := ca.Write([]byte("!")); err != nil {
			return
		}
		for time.Since(start) < time.Second && !stop.Load() {
		}
		inFlight.Store(false)
	}()
	go func() {
		if _, err := cb.Read(make([]byte, 1)); err == nil {
			otherRan <- time.Now()
		}
		close(otherRan)
	}()
	// The word that all is set (on the second connection: each has one
	// writer). The goroutines wait in the poller, and this one waits on a
	// channel from here on: the process idles, and the runtime's monitor
	// with it, until the child's byte.
	if _, err := cb.Write([]byte("!")); err != nil {
		t.Fatal(err)
	}
	start := <-spinning
	if start.IsZero() {
		t.Fatal("the first connection's read failed")
	}
	ran, ok := <-otherRan
	if !ok {
		t.Fatal("the second connection's read failed")
	}
	return ran.Sub(start)
}

// The ticks run every monitorEvery while requests are in flight, stop at
// the first tick that finds none, and start again with the next arm; an
// arm while they run changes nothing. On a fake clock.
func TestMonitorTickTicksWhileBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var busy atomic.Bool
		var looks atomic.Int64 // busy's calls: one a tick while busy, two at the stop
		m := NewMonitorTick(func() bool { looks.Add(1); return busy.Load() })
		after := func(d time.Duration) { <-time.After(d); synctest.Wait() }

		busy.Store(true)
		m.Arm()
		after(monitorEvery*4 + monitorEvery/2)
		m.Arm() // running: no second timer
		after(monitorEvery * 4)
		if n := looks.Load(); n != 8 {
			t.Fatalf("%d ticks in 8.5 periods while busy, want 8", n)
		}
		busy.Store(false)
		after(monitorEvery)
		if m.armed.Load() {
			t.Fatal("the ticks run on with nothing in flight")
		}
		after(monitorEvery * 10)
		if n := looks.Load(); n != 10 {
			t.Fatalf("%d looks after the stop, want 10 (the stopping tick looks twice, then none)", n)
		}
		busy.Store(true)
		m.Arm()
		if !m.armed.Load() {
			t.Fatal("arm did not start the ticks again")
		}
		after(monitorEvery)
		if n := looks.Load(); n != 11 {
			t.Fatalf("%d looks, want 11: the ticks did not start again", n)
		}
		busy.Store(false)
		after(monitorEvery) // let the ticks stop before the bubble ends
	})
}
