// Package redistest starts a real redis-server on a free 127.0.0.1 port
// for a test (Debian's redis-server; CI installs it): the shared
// admission store's tests run against the real thing.
package redistest

import (
	"context"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Server is a redis-server a test started; it is killed at the test's end.
type Server struct {
	tb   testing.TB
	Addr string
	cmd  *exec.Cmd
	// Password, when set before Restart (StartWithPassword), is the one
	// the server requires.
	Password string
}

// Start starts a redis-server, or skips the test when there is none (and
// fails it under CI, which installs one).
func Start(tb testing.TB) *Server { return StartWithPassword(tb, "") }

// StartWithPassword starts a redis-server that requires password (none:
// "").
func StartWithPassword(tb testing.TB, password string) *Server {
	tb.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") != "" {
			tb.Fatal("redis-server is missing: .ci/run installs Debian's redis-server package")
		}
		tb.Skip("redis-server not installed (Debian: apt-get install redis-server)")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	s := &Server{tb: tb, Addr: ln.Addr().String(), Password: password}
	ln.Close()
	s.Restart()
	tb.Cleanup(s.Stop)
	return s
}

// Restart starts the server again on its address (after Stop).
func (s *Server) Restart() {
	_, port, _ := net.SplitHostPort(s.Addr)
	args := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", s.tb.TempDir()}
	if s.Password != "" {
		args = append(args, "--requirepass", s.Password)
	}
	s.cmd = exec.Command("redis-server", args...)
	if err := s.cmd.Start(); err != nil {
		s.tb.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.Addr, Password: s.Password})
	defer c.Close()
	for deadline := time.Now().Add(10 * time.Second); c.Ping(context.Background()).Err() != nil; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			s.tb.Fatal("redis-server did not answer")
		}
	}
}

// Pause stops the server's process (SIGSTOP): it keeps its connections
// and accepts new ones (the kernel does), but answers nothing until
// Resume, as a hung server.
func (s *Server) Pause() { s.signal(syscall.SIGSTOP) }

// Resume lets a paused server run again.
func (s *Server) Resume() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	if s.cmd != nil && s.cmd.Process != nil {
		if err := s.cmd.Process.Signal(sig); err != nil {
			s.tb.Fatal(err)
		}
	}
}

// Stop kills the server (as a crash would).
func (s *Server) Stop() {
	if s.cmd != nil && s.cmd.Process != nil {
		_ = s.cmd.Process.Signal(syscall.SIGCONT) // a paused one too
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
		s.cmd = nil
	}
}

// Client returns a client of the server, closed at the test's end.
func (s *Server) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr, Password: s.Password})
	s.tb.Cleanup(func() { c.Close() })
	return c
}

// Delayed starts a TCP relay to the server that holds every byte d in each
// direction (as a store d/2 away would, twice over: one round trip costs
// 2d), keeping pipelined bytes in order; its address is returned and it
// stops at the test's end.
func (s *Server) Delayed(d time.Duration) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.tb.Fatal(err)
	}
	var wg sync.WaitGroup
	s.tb.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", s.Addr)
			if err != nil {
				c.Close()
				continue
			}
			wg.Go(func() { delayCopy(u, c, d) })
			wg.Go(func() { delayCopy(c, u, d) })
		}
	})
	return ln.Addr().String()
}

// delayCopy copies src to dst, each read written d after it arrived; it
// closes both when either side ends.
func delayCopy(dst, src net.Conn, d time.Duration) {
	type piece struct {
		at time.Time
		b  []byte
	}
	ch := make(chan piece, 1024)
	go func() {
		defer close(ch)
		for {
			b := make([]byte, 32<<10)
			n, err := src.Read(b)
			if n > 0 {
				ch <- piece{time.Now().Add(d), b[:n]}
			}
			if err != nil {
				return
			}
		}
	}()
	for p := range ch {
		time.Sleep(time.Until(p.at))
		if _, err := dst.Write(p.b); err != nil {
			break
		}
	}
	dst.Close()
	src.Close()
	for range ch { // the reader ends with src closed
	}
}
