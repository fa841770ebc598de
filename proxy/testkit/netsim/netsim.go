//go:build linux

// Package netsim makes a slow network link on one machine, for tests: two
// network namespaces joined by a pair of TUN devices and a forwarder that
// holds each IP packet for a one-way delay, with optional jitter and loss
// (this kernel has no netem). Root is needed (Available says why not).
//
//	l, err := netsim.New(netsim.Options{Delay: 20 * time.Millisecond})
//	defer l.Close()
//	ln, err := l.A.Listen("tcp", l.A.Addr.String()+":0")   // a server in A
//	c, err := l.B.Dial(ctx, "tcp", ln.Addr().String())      // a client in B
//
// Sockets belong to the namespace they were made in; Listen, Dial and Do
// make them on an OS thread that entered the namespace. Everything else
// (the process's own dials, for instance) stays in the process's
// namespace.
package netsim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Options shape the link. Each direction gets the same.
type Options struct {
	// Delay is the one-way delay: a round trip takes twice as long.
	Delay time.Duration
	// Jitter spreads each packet's delay uniformly over Delay ± Jitter;
	// packets keep their order.
	Jitter time.Duration
	// Loss is the share of packets dropped (0 … 1).
	Loss float64
	// Rate is the bandwidth from A to B in bytes per second (0:
	// unlimited), the way a server's responses take: each packet takes its
	// size over Rate to go out, and packets queue behind those still going
	// out (a bottleneck's queue, up to 8,192 packets), before the delay.
	// From B to A (requests, acknowledgements) there is no such limit.
	Rate int64
	// Seed seeds jitter and loss (0: a fixed seed).
	Seed uint64
}

// NS is one end of the link: a network namespace with its TUN device.
type NS struct {
	Name string
	Addr netip.Addr // the address of this end's TUN device
	fd   int        // the namespace, for setns
	tun  *os.File
}

// Link is two namespaces, A (10.77.0.1) and B (10.77.0.2), and the
// forwarder between them.
type Link struct {
	A, B *NS
	o    Options
	fwd  *exec.Cmd
	stop io.WriteCloser // closing it stops the forwarder
	out  bytes.Buffer   // the forwarder's counts, written as it stops
	once sync.Once
	err  error
	// Dropped counts the packets lost on purpose (or to a full queue),
	// Forwarded the others; both are set by Close.
	Dropped, Forwarded int64
	// Late lists the packets the forwarder released more than LateBy after
	// their due time (a machine too busy to run it at once), set by Close.
	// On those packets the link was slower than its Options say.
	Late []Late
	// Wire is every TCP packet with data (or a SYN) as B's device saw
	// it: when it left B, or when it reached B from A. Set by Close.
	Wire []Seen
}

// Seen is one TCP packet on B's device.
type Seen struct {
	At               time.Time
	ToB              bool // from A to B (else from B to A)
	SrcPort, DstPort uint16
	Seq              uint32
	Len              int
	SYN              bool
}

// WireTime returns when the byte at offset (from 0, the first data byte
// of the connection) of the direction toB of B's connection on port left
// or reached B's device: the first packet that carried it and got through.
func (l *Link) WireTime(port uint16, toB bool, offset int64) (time.Time, bool) {
	var isn uint32
	found := false
	for _, p := range l.Wire {
		if p.ToB != toB || (toB && p.DstPort != port) || (!toB && p.SrcPort != port) {
			continue
		}
		if p.SYN {
			isn, found = p.Seq, true
			continue
		}
		if !found {
			continue
		}
		from := int64(p.Seq - isn - 1)
		if from <= offset && offset < from+int64(p.Len) {
			return p.At, true
		}
	}
	return time.Time{}, false
}

// LateBy is how late a packet's release must be to count as Late: about
// what a sleep that ends on time spends in the scheduler here.
const LateBy = 250 * time.Microsecond

// Late is one packet the forwarder released late.
type Late struct {
	Due              time.Time     // when it was due
	By               time.Duration // how late it went out
	SrcPort, DstPort uint16        // its TCP ports (0: not a TCP packet)
}

// LateOn returns how late, at most, the forwarder released the packets to
// or from TCP port port that were due within [from, to], or 0.
func (l *Link) LateOn(port uint16, from, to time.Time) time.Duration {
	var worst time.Duration
	for _, p := range l.Late {
		if (p.SrcPort == port || p.DstPort == port) && !p.Due.Before(from) && !p.Due.After(to) {
			worst = max(worst, p.By)
		}
	}
	return worst
}

var seq atomic.Int64

// Available reports why a link cannot be made here, or nil.
func Available() error {
	if os.Geteuid() != 0 {
		return errors.New("netsim needs root (network namespaces and TUN devices)")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		return fmt.Errorf("netsim needs /dev/net/tun: %w", err)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return errors.New("netsim needs ip (Debian: iproute2)")
	}
	return nil
}

// New makes the link. Close removes it.
func New(o Options) (*Link, error) {
	if err := Available(); err != nil {
		return nil, err
	}
	n := seq.Add(1)
	l := &Link{o: o}
	var err error
	if l.A, err = newNS(fmt.Sprintf("tt%d-%d-a", os.Getpid(), n), netip.MustParseAddr("10.77.0.1"), netip.MustParseAddr("10.77.0.2")); err != nil {
		return nil, err
	}
	if l.B, err = newNS(fmt.Sprintf("tt%d-%d-b", os.Getpid(), n), netip.MustParseAddr("10.77.0.2"), netip.MustParseAddr("10.77.0.1")); err != nil {
		l.A.remove()
		return nil, err
	}
	if err := l.startForwarder(); err != nil {
		l.A.remove()
		l.B.remove()
		return nil, err
	}
	return l, nil
}

// The forwarder runs in a process of its own (this program again, see
// ServeForwarder): inside the test's process its threads would wait for
// the Go scheduler behind the test's own goroutines, up to 10 ms on a busy
// machine, and the link would add that to its delay as jitter. Its own
// threads run at a real-time priority where the system allows it.
const envForwarder = "TOKENTAP_NETSIM_FORWARDER"

func (l *Link) startForwarder() error {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d,%d,%g,%d,%d", envForwarder, l.o.Delay, l.o.Jitter, l.o.Loss, l.o.Seed, l.o.Rate), "GOMAXPROCS=4")
	cmd.ExtraFiles = []*os.File{l.A.tun, l.B.tun}
	cmd.Stdout = &l.out
	cmd.Stderr = os.Stderr
	stop, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("netsim forwarder: %w", err)
	}
	l.fwd, l.stop = cmd, stop
	// The forwarder holds the devices now.
	l.A.tun.Close()
	l.B.tun.Close()
	l.A.tun, l.B.tun = nil, nil
	return nil
}

// ServeForwarder makes this process a link's forwarder when it was started
// as one, and exits when the link closes; otherwise it returns at once.
// Call it first in TestMain of every package whose tests make links:
//
//	func TestMain(m *testing.M) { netsim.ServeForwarder(); os.Exit(m.Run()) }
func ServeForwarder() {
	spec := os.Getenv(envForwarder)
	if spec == "" {
		return
	}
	var o Options
	var delay, jitter int64
	if _, err := fmt.Sscanf(strings.ReplaceAll(spec, ",", " "), "%d %d %g %d %d", &delay, &jitter, &o.Loss, &o.Seed, &o.Rate); err != nil {
		fmt.Fprintln(os.Stderr, "netsim forwarder:", err)
		os.Exit(2)
	}
	o.Delay, o.Jitter = time.Duration(delay), time.Duration(jitter)
	seed := o.Seed
	if seed == 0 {
		seed = 1
	}
	var dropped, forwarded atomic.Int64
	var late lateLog
	var wire wireLog
	for i, dir := range [][2]int{{3, 4}, {4, 3}} {
		for _, fd := range dir {
			_ = unix.SetNonblock(fd, false)
		}
		od := o
		if i == 1 {
			od.Rate = 0 // B to A
		}
		go forward(od, dir[0], dir[1], i == 0, rand.New(rand.NewPCG(seed, uint64(i+1))), &dropped, &forwarded, &late, &wire)
	}
	_, _ = io.Copy(io.Discard, os.Stdin) // until the link closes
	fmt.Printf("%d %d\n", dropped.Load(), forwarded.Load())
	late.mu.Lock() // held to the exit: the writers may still note packets
	for _, p := range late.p {
		fmt.Printf("%d %d %d %d\n", p.Due.UnixNano(), p.By, p.SrcPort, p.DstPort)
	}
	wire.mu.Lock()
	for _, p := range wire.p {
		fmt.Printf("w %t %d %d %d %d %d %t\n", p.ToB, p.At.UnixNano(), p.SrcPort, p.DstPort, p.Seq, p.Len, p.SYN)
	}
	os.Exit(0)
}

// Realtime moves the calling thread (lock it first) to a real-time
// priority, so that it runs the moment its sleep or read ends. Without the
// right to, it stays as it is.
func Realtime() {
	_ = unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: unix.SCHED_FIFO, Priority: 10}, 0)
}

func ip(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %v: %v: %s", args, err, out)
	}
	return nil
}

func newNS(name string, addr, peer netip.Addr) (*NS, error) {
	if err := ip("netns", "add", name); err != nil {
		return nil, err
	}
	n := &NS{Name: name, Addr: addr, fd: -1}
	fail := func(err error) (*NS, error) {
		n.remove()
		return nil, err
	}
	fd, err := unix.Open("/var/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail(err)
	}
	n.fd = fd
	var tunFD int
	err = n.Do(func() error {
		var err error
		tunFD, err = openTUN("tt0")
		return err
	})
	if err != nil {
		return fail(fmt.Errorf("tun in %s: %w", name, err))
	}
	n.tun = os.NewFile(uintptr(tunFD), "tun-"+name)
	for _, args := range [][]string{
		{"-n", name, "link", "set", "lo", "up"},
		{"-n", name, "addr", "add", addr.String(), "peer", peer.String(), "dev", "tt0"},
		{"-n", name, "link", "set", "tt0", "up"},
	} {
		if err := ip(args...); err != nil {
			return fail(err)
		}
	}
	return n, nil
}

// openTUN makes a TUN device (IP packets, no header) in the calling
// thread's namespace, non-blocking so that Go's poller serves it.
func openTUN(name string) (int, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return -1, err
	}
	var req [unix.IFNAMSIZ + 64]byte
	copy(req[:], name)
	*(*uint16)(unsafe.Pointer(&req[unix.IFNAMSIZ])) = unix.IFF_TUN | unix.IFF_NO_PI
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TUNSETIFF, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
		unix.Close(fd)
		return -1, errno
	}
	return fd, nil
}

func (n *NS) remove() {
	if n.tun != nil {
		n.tun.Close()
	}
	if n.fd >= 0 {
		unix.Close(n.fd)
	}
	_ = ip("netns", "del", n.Name)
}

// Do runs f on an OS thread inside the namespace: sockets f makes belong
// to it. The thread ends with f (it never returns to the pool).
func (n *NS) Do(f func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // not unlocked: the thread dies with the goroutine
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("setns %s: %w", n.Name, err)
			return
		}
		errc <- f()
	}()
	return <-errc
}

// Start starts cmd inside the namespace: the child is forked from a
// thread that entered it, and stays there.
func (n *NS) Start(cmd *exec.Cmd) error {
	return n.Do(cmd.Start)
}

// Listen opens a listener inside the namespace.
func (n *NS) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := n.Do(func() (err error) {
		ln, err = net.Listen(network, addr)
		return err
	})
	return ln, err
}

// Dial connects from inside the namespace.
func (n *NS) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := n.Do(func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// spin is how long before a packet's due time its writer stops sleeping
// and spins.
const spin = 300 * time.Microsecond

type packet struct {
	b   []byte
	due time.Time
}

// lateLog collects the late packets of both directions.
type lateLog struct {
	mu sync.Mutex
	p  []Late
}

// maxLate bounds the late packets a forwarder keeps.
const maxLate = 100000

func (g *lateLog) note(b []byte, due time.Time, by time.Duration) {
	sp, dp := tcpPorts(b)
	g.mu.Lock()
	if len(g.p) < maxLate {
		g.p = append(g.p, Late{Due: due, By: by, SrcPort: sp, DstPort: dp})
	}
	g.mu.Unlock()
}

// wireLog collects the TCP packets with data, and SYNs, on B's device.
type wireLog struct {
	mu sync.Mutex
	p  []Seen
}

// maxWire bounds the packets a forwarder keeps.
const maxWire = 1 << 20

func (g *wireLog) note(b []byte, at time.Time, toB bool) {
	if len(b) < 20 || b[0]>>4 != 4 || b[9] != unix.IPPROTO_TCP {
		return
	}
	h := int(b[0]&0x0f) * 4
	if len(b) < h+20 {
		return
	}
	t := b[h:]
	total := int(b[2])<<8 | int(b[3])
	n := total - h - int(t[12]>>4)*4
	syn := t[13]&0x02 != 0
	if n <= 0 && !syn {
		return
	}
	sp, dp := tcpPorts(b)
	s := Seen{At: at, ToB: toB, SrcPort: sp, DstPort: dp,
		Seq: uint32(t[4])<<24 | uint32(t[5])<<16 | uint32(t[6])<<8 | uint32(t[7]), Len: max(n, 0), SYN: syn}
	g.mu.Lock()
	if len(g.p) < maxWire {
		g.p = append(g.p, s)
	}
	g.mu.Unlock()
}

// tcpPorts returns the ports of an IPv4 TCP packet, or zeros.
func tcpPorts(b []byte) (src, dst uint16) {
	if len(b) < 20 || b[0]>>4 != 4 || b[9] != unix.IPPROTO_TCP {
		return 0, 0
	}
	h := int(b[0]&0x0f) * 4
	if len(b) < h+4 {
		return 0, 0
	}
	return uint16(b[h])<<8 | uint16(b[h+1]), uint16(b[h+2])<<8 | uint16(b[h+3])
}

// forward moves packets from one TUN device to the other, each held until
// its due time. A thread reads, another writes, each locked and sleeping in
// the kernel, so reading never waits for a held packet.
func forward(o Options, from, to int, toB bool, rng *rand.Rand, dropped, forwarded *atomic.Int64, late *lateLog, wire *wireLog) {
	q := make(chan packet, 8192)
	go func() {
		runtime.LockOSThread()
		Realtime()
		for p := range q {
			// Sleep to just before the due time, then spin to it: a
			// sleep ends 0.15 ms late on average on a virtual machine.
			if d := time.Until(p.due) - spin; d > 0 {
				ts := unix.NsecToTimespec(d.Nanoseconds())
				for unix.Nanosleep(&ts, &ts) == unix.EINTR {
				}
			}
			for time.Now().Before(p.due) {
			}
			_, _ = unix.Write(to, p.b)
			if toB {
				wire.note(p.b, time.Now(), true)
			}
			if by := time.Since(p.due); by > LateBy {
				late.note(p.b, p.due, by)
			}
		}
	}()
	runtime.LockOSThread()
	Realtime()
	var last, sent time.Time // the last due time; when the bottleneck is free
	buf := make([]byte, 65536)
	for {
		n, err := unix.Read(from, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil || n <= 0 {
			close(q)
			return
		}
		if !toB {
			wire.note(buf[:n], time.Now(), false)
		}
		if o.Loss > 0 && rng.Float64() < o.Loss {
			dropped.Add(1)
			continue
		}
		delay := o.Delay
		if o.Jitter > 0 {
			delay += time.Duration((2*rng.Float64() - 1) * float64(o.Jitter))
		}
		now := time.Now()
		if o.Rate > 0 {
			// Out of the bottleneck once those ahead of it are, and its
			// own bytes went out.
			if sent.Before(now) {
				sent = now
			}
			sent = sent.Add(time.Duration(int64(n) * int64(time.Second) / o.Rate))
			now = sent
		}
		due := now.Add(max(delay, 0))
		if due.Before(last) {
			due = last // keep the order
		}
		last = due
		select {
		case q <- packet{b: append([]byte(nil), buf[:n]...), due: due}:
			forwarded.Add(1)
		default:
			dropped.Add(1) // a full queue drops, as a router's does
		}
	}
}

// readCounts reads what the forwarder wrote as it stopped: its counts on
// the first line, then a line per late packet (due time in Unix ns,
// lateness in ns, source and destination ports).
func (l *Link) readCounts() {
	lines := strings.Split(strings.TrimSpace(l.out.String()), "\n")
	fmt.Sscan(lines[0], &l.Dropped, &l.Forwarded)
	for _, line := range lines[1:] {
		if strings.HasPrefix(line, "w ") {
			var s Seen
			var at int64
			if _, err := fmt.Sscan(line[2:], &s.ToB, &at, &s.SrcPort, &s.DstPort, &s.Seq, &s.Len, &s.SYN); err == nil {
				s.At = time.Unix(0, at)
				l.Wire = append(l.Wire, s)
			}
			continue
		}
		var due, by int64
		var sp, dp uint16
		if _, err := fmt.Sscan(line, &due, &by, &sp, &dp); err == nil {
			l.Late = append(l.Late, Late{Due: time.Unix(0, due), By: time.Duration(by), SrcPort: sp, DstPort: dp})
		}
	}
}

// Close stops the forwarder, reads its counts and late packets and removes
// both namespaces.
func (l *Link) Close() error {
	l.once.Do(func() {
		l.stop.Close()
		l.err = l.fwd.Wait()
		l.readCounts()
		l.A.remove()
		l.B.remove()
	})
	return l.err
}
