package relayplane

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The relay loop alone: scripted streams over socket pairs, no exchange
// and no server.

// pipeStream is a Stream that passes what it reads as it came and ends at
// the upstream's end.
type pipeStream struct {
	buf     []byte
	err     error // the read's
	upFd    int
	sent    int
	stalled time.Duration
	cancels int
	failed  error
	entered chan struct{} // Entered
	done    chan error    // Ended's err
}

func (p *pipeStream) Read(fd int, events uint32) (out []byte, wait, got, again bool) {
	n, err := unix.Read(fd, p.buf)
	switch {
	case err == unix.EAGAIN:
		return nil, true, false, false
	case err != nil:
		p.err = err
		return nil, false, false, false
	case n == 0:
		p.err = io.EOF
		return nil, false, false, false
	}
	return p.buf[:n], false, true, n == len(p.buf) || events&(unix.EPOLLRDHUP|unix.EPOLLHUP) != 0
}

func (p *pipeStream) Written() (bool, error) {
	if p.err == io.EOF {
		return true, nil
	}
	return p.err != nil, p.err
}

// Note counts what the loop tells; a client that left is answered as an
// exchange's cancel answers a stream in a loop: the upstream socket is
// shut down, which ends the stream.
func (p *pipeStream) Note(e Event) {
	switch e.Kind {
	case Sent:
		p.sent += e.N
	case Stalled:
		p.stalled += e.D
	case ClientLeft:
		p.cancels++
		_ = unix.Shutdown(p.upFd, unix.SHUT_RDWR)
	case Failed:
		if !e.KeepRead {
			p.err = e.Err
		}
		p.failed = e.Err
	case Entered:
		p.entered <- struct{}{}
	case Ended:
		p.done <- e.Err
	}
}

// sockPair returns a non-blocking socket for the loop and its peer as a
// net.Conn for the test.
func sockPair(t *testing.T) (int, net.Conn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[1]), "peer")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = unix.Close(fds[0])
		_ = c.Close()
	})
	return fds[0], c
}

// loopCase is one stream through a loop: up is written by the test as an
// upstream, client read as the client.
type loopCase struct {
	s      Handle
	p      *pipeStream
	up     net.Conn
	client net.Conn
}

func newLoopCase(t *testing.T, idle, wtime time.Duration) *loopCase {
	upFd, up := sockPair(t)
	clFd, client := sockPair(t)
	p := &pipeStream{buf: make([]byte, 8<<10), upFd: upFd, entered: make(chan struct{}, 1), done: make(chan error, 1)}
	c := &loopCase{p: p, up: up, client: client}
	c.s = Handle{S: p, UpFd: upFd, ClFd: clFd, Idle: idle, WriteTimeout: wtime}
	return c
}

// startLoop runs one loop on the real clock until the test ends.
func startLoop(t *testing.T) (*Set, *Loop) {
	t.Helper()
	ls := &Set{}
	ls.Start(1, time.Now)
	l := ls.Pick()
	if l == nil {
		t.Skip("no relay loop on this system")
	}
	t.Cleanup(ls.Stop)
	return ls, l
}

// ended waits for c's stream to leave the loop (bounded: a stream that
// never ends fails the test instead of hanging it).
func ended(t *testing.T, c *loopCase) error {
	t.Helper()
	select {
	case err := <-c.p.done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("the stream never left the loop")
		return nil
	}
}

// Many streams at once, in three rounds on one loop: each client gets
// exactly its upstream's bytes, in order, and the slots of ended streams
// are reused (the loop's table never grows past the streams open at
// once).
func TestLoopRelaysManyStreamsAndReusesSlots(t *testing.T) {
	ls, l := startLoop(t)
	const streams = 24
	for round := range 3 {
		cases := make([]*loopCase, streams)
		want := make([][]byte, streams)
		for i := range cases {
			cases[i] = newLoopCase(t, time.Minute, time.Minute)
			want[i] = make([]byte, 1+rand.IntN(200<<10))
			for k := range want[i] {
				want[i][k] = byte(rand.Uint32())
			}
			if !l.Post(&cases[i].s) {
				t.Fatal("the loop refused a stream")
			}
		}
		var wg sync.WaitGroup
		got := make([][]byte, streams)
		for i, c := range cases {
			wg.Add(2)
			go func() {
				defer wg.Done()
				b := want[i]
				for len(b) > 0 { // in pieces, as a backend streams
					k := min(len(b), 1+rand.IntN(9000))
					if _, err := c.up.Write(b[:k]); err != nil {
						t.Error(err)
						return
					}
					b = b[k:]
				}
				_ = c.up.Close()
			}()
			go func() {
				defer wg.Done()
				got[i], _ = io.ReadAll(io.LimitReader(c.client, int64(len(want[i]))))
			}()
		}
		wg.Wait()
		for i, c := range cases {
			if err := ended(t, c); err != nil {
				t.Fatalf("round %d stream %d ended with %v", round, i, err)
			}
			if !bytes.Equal(got[i], want[i]) || c.p.sent != len(want[i]) {
				t.Fatalf("round %d stream %d: the client read %d bytes (loop sent %d), want %d the same", round, i, len(got[i]), c.p.sent, len(want[i]))
			}
		}
	}
	ls.Stop() // the loop's goroutine returns: its table can be read
	if len(l.slots) > streams {
		t.Fatalf("%d slots for %d streams at once: ended streams' slots were not reused", len(l.slots), streams)
	}
}

// A client that does not read: the loop stops reading the upstream when
// the client's socket is full, waits for it to be writable (EPOLLOUT) and
// counts the wait; once the client reads, every byte arrives.
func TestLoopWaitsForAFullClientSocket(t *testing.T) {
	_, l := startLoop(t)
	c := newLoopCase(t, time.Minute, time.Minute)
	// The smallest buffer towards the client: each 8 KiB read meets a full
	// socket unless the client happens to be reading at that very moment.
	if err := unix.SetsockoptInt(c.s.ClFd, unix.SOL_SOCKET, unix.SO_SNDBUF, 1); err != nil {
		t.Fatal(err)
	}
	l.Post(&c.s)
	want := bytes.Repeat([]byte("0123456789abcdef"), 256<<10) // 4 MiB: far beyond the sockets' buffers
	go func() {
		_, _ = c.up.Write(want)
		_ = c.up.Close()
	}()
	time.Sleep(200 * time.Millisecond) // the client's socket fills
	got, err := io.ReadAll(io.LimitReader(c.client, int64(len(want))))
	if err != nil {
		t.Fatal(err)
	}
	if err := ended(t, c); err != nil {
		t.Fatalf("the stream ended with %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("the client read %d bytes, want %d the same", len(got), len(want))
	}
	if c.p.stalled <= 0 {
		t.Fatal("no wait for the client's socket was counted")
	}
}

// A silent upstream ends its stream at the idle timeout, as a read error
// the stream keeps; a client that takes nothing ends it at the write
// timeout, the read's own error kept.
func TestLoopTimeouts(t *testing.T) {
	_, l := startLoop(t)
	idle := newLoopCase(t, 50*time.Millisecond, time.Minute)
	start := time.Now()
	l.Post(&idle.s)
	err := ended(t, idle)
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "read" || !errors.Is(err, os.ErrDeadlineExceeded) || idle.p.err != err {
		t.Fatalf("idle upstream: ended with %v (the stream's read error %v)", err, idle.p.err)
	}
	if d := time.Since(start); d < 50*time.Millisecond {
		t.Fatalf("ended after %v, before the 50 ms idle timeout", d)
	}

	stuck := newLoopCase(t, time.Minute, 50*time.Millisecond)
	l.Post(&stuck.s)
	go func() {
		chunk := make([]byte, 64<<10)
		for {
			if _, err := stuck.up.Write(chunk); err != nil {
				return
			}
		}
	}()
	err = ended(t, stuck)
	if !errors.As(err, &op) || op.Op != "write" || !errors.Is(err, os.ErrDeadlineExceeded) || stuck.p.err != nil {
		t.Fatalf("client that takes nothing: ended with %v (the stream's read error %v)", err, stuck.p.err)
	}
	_ = stuck.up.Close()
}

// A client that closes its side with nothing waiting has left: the loop
// cancels the stream (which here, as in the exchange, shuts the upstream
// down and so ends it). One that sent more first (a pipelined request)
// has not: its stream goes on to its end. A client whose socket hangs up
// ends its stream as a failed write.
func TestLoopClientHalfCloseAndHangUp(t *testing.T) {
	_, l := startLoop(t)

	left := newLoopCase(t, time.Minute, time.Minute)
	l.Post(&left.s)
	_ = left.client.(*net.UnixConn).CloseWrite()
	if err := ended(t, left); err != nil || left.p.cancels != 1 {
		t.Fatalf("client left: ended with %v after %d cancels, want nil after 1", err, left.p.cancels)
	}

	pipelined := newLoopCase(t, time.Minute, time.Minute)
	l.Post(&pipelined.s)
	if _, err := pipelined.client.Write([]byte("GET /next HTTP/1.1\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	_ = pipelined.client.(*net.UnixConn).CloseWrite()
	time.Sleep(20 * time.Millisecond) // the loop sees the close first
	if _, err := pipelined.up.Write([]byte("data")); err != nil {
		t.Fatal(err)
	}
	_ = pipelined.up.Close()
	got, _ := io.ReadAll(io.LimitReader(pipelined.client, 4))
	if err := ended(t, pipelined); err != nil || pipelined.p.cancels != 0 || string(got) != "data" {
		t.Fatalf("pipelined then half-closed: ended with %v after %d cancels, client read %q", err, pipelined.p.cancels, got)
	}

	gone := newLoopCase(t, time.Minute, time.Minute)
	l.Post(&gone.s)
	_ = gone.client.Close()
	if err := ended(t, gone); !errors.Is(err, unix.EPIPE) {
		t.Fatalf("client hung up: ended with %v", err)
	}
}

// An upstream that writes its last bytes and its end at once: the loop
// relays the bytes and ends the stream on the same wake-up, not at the
// idle timeout (an hour here).
func TestLoopBytesAndEndTogether(t *testing.T) {
	_, l := startLoop(t)
	for _, size := range []int{5, 8 << 10, 8<<10 + 1, 100 << 10} {
		c := newLoopCase(t, time.Hour, time.Minute)
		want := bytes.Repeat([]byte{'x'}, size)
		if _, err := c.up.Write(want[:min(size, 4<<10)]); err != nil { // what fits at once
			t.Fatal(err)
		}
		l.Post(&c.s)
		go func() {
			_, _ = c.up.Write(want[min(size, 4<<10):])
			_ = c.up.Close()
		}()
		got, _ := io.ReadAll(io.LimitReader(c.client, int64(size)))
		if err := ended(t, c); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%d bytes then the end: ended with %v, client read %d", size, err, len(got))
		}
	}
}

// Stopping a loop ends the streams still in it (ErrLoopStopped), closes
// its descriptors and ends its goroutine; it takes no stream after.
func TestLoopStopEndsStreamsAndClosesDescriptors(t *testing.T) {
	ls, l := startLoop(t)
	c := newLoopCase(t, time.Hour, time.Hour)
	l.Post(&c.s)
	<-c.p.entered // in the loop's table, not still posted
	ls.Stop()
	if err := ended(t, c); err != ErrLoopStopped {
		t.Fatalf("the stream in the stopped loop ended with %v", err)
	}
	select {
	case <-l.exited:
	default:
		t.Fatal("stop returned before the loop's goroutine")
	}
	if l.file.Fd() != ^uintptr(0) {
		t.Fatal("the epoll descriptor is still open")
	}
	if _, err := unix.FcntlInt(uintptr(l.efd), unix.F_GETFD, 0); err == nil {
		t.Fatal("the eventfd is still open")
	}
	if l.Post(&newLoopCase(t, time.Hour, time.Hour).s) {
		t.Fatal("a stopped loop took a stream")
	}
	if ls.Pick() != nil {
		t.Fatal("a stopped set still gives a loop")
	}
}
