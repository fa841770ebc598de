// Package downstream is the client's side of the relay's connections:
// the listener that caps and wraps what it accepts (Listener, Caps), the
// connection with its sliding write deadline, its kernel receive stamps
// and its delivery counters (Conn, TLSConn over TLS), the watch for a
// client that leaves (Watch) and what it cancels (Cancel), the runtime
// monitor's ticks while requests are in flight (MonitorTick), and a
// listener's TLS files (ServerTLS). It knows nothing of requests: the
// exchange hands it what to watch and cancel.
package downstream

import (
	"bytes"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/relayplane"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/measure"
	"go.uber.org/zap"
)

// Listener wraps accepted connections in Conn, keeps accepting
// through transient errors, and caps the open connections.
type Listener struct {
	net.Listener
	d       time.Duration
	idle    time.Duration // the wait for a request on a connection given back (Conn.idle)
	read    time.Duration // the request read timeout (Conn.read)
	stamped bool          // receive timestamps are enabled on the listening socket
	caps    *Caps
	log     *zap.Logger
	tls     *tls.Config // nil: plain connections
}

// ListenerOptions are what a Listener gives each connection it accepts.
type ListenerOptions struct {
	// WriteTimeout bounds each write to a client (the sliding deadline);
	// IdleWait is how long a connection given back to the server waits for
	// its next request; ReadTimeout bounds reading a request once its
	// first byte came.
	WriteTimeout, IdleWait, ReadTimeout time.Duration
	Caps                                *Caps
	Log                                 *zap.Logger // nil: no logging
}

// MaxUnsent is the most bytes a client connection's socket holds written
// and not yet sent while it carries a token stream (Conn.Streaming): past
// it, writes wait for the client, and that wait is the client's stall
// (Conn.Stall, and the reader model's "held by the client"). 4 KiB: a
// burst of tens of tokens; at 16 KiB a reader with a small receive buffer
// was measured 110 ms ahead of what its application read, at 4 KiB 3 ms.
const MaxUnsent = 4 << 10

// NewListener wraps ln: its connections carry the kernel's receive stamps
// when ln is a TCP listener they can be enabled on.
func NewListener(ln net.Listener, o ListenerOptions) *Listener {
	l := &Listener{Listener: ln, d: o.WriteTimeout, idle: o.IdleWait, read: o.ReadTimeout, caps: o.Caps, log: o.Log}
	if tl, ok := ln.(*net.TCPListener); ok {
		if raw, err := tl.SyscallConn(); err == nil && sock.EnableRxStamps(raw) == nil {
			l.stamped = true
		}
	}
	return l
}

// ServeTLS has every connection accepted from now on speak TLS by cfg.
func (l *Listener) ServeTLS(cfg *tls.Config) { l.tls = cfg }

// Accept returns the next connection within the caps. A failed accept
// (out of descriptors, out of memory, a connection reset while queued) is
// counted and retried after a pause that doubles from 5 ms to 1 s, as
// net/http does, so one burst of connections can never stop the server;
// only a closed listener ends it. A connection beyond a cap is answered 503
// and closed at once.
func (l *Listener) Accept() (net.Conn, error) {
	var delay time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil, err
			}
			metrics.AcceptError()
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			if l.log != nil && delay == 5*time.Millisecond {
				l.log.Warn("cannot accept a connection, retrying", zap.Error(err))
			}
			time.Sleep(delay)
			continue
		}
		delay = 0
		tc, ok := c.(*net.TCPConn)
		if !ok {
			return c, nil
		}
		ip := tc.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
		if reason := l.caps.take(ip); reason != "" {
			metrics.ConnRefused(reason)
			refuseConn(tc)
			continue
		}
		cc := &Conn{Conn: sock.NewConn(tc, l.stamped), d: l.d, idle: l.idle, read: l.read, caps: l.caps, inHead: true}
		cc.IP = ip
		cc.Sys, _ = tc.SyscallConn()
		var ti sock.TCPInfo
		cc.Accepted(&ti)
		l.caps.track(cc)
		if l.tls != nil {
			return newTLSConn(cc, l.tls), nil
		}
		return cc, nil
	}
}

// busyResponse is what a connection beyond a cap receives before it is closed.
var busyResponse = func() []byte {
	body := `{"error":{"type":"tokentap_error","code":"too_many_connections","message":"too many connections"}}` + "\n"
	return []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}()

// refuseConn answers 503 without reading the request and closes. The write
// fits in the socket's send buffer; the deadline only guards the syscall.
func refuseConn(c *net.TCPConn) {
	_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_, _ = c.Write(busyResponse)
	_ = c.Close()
}

// Caps counts open client connections, in all and per client address,
// and knows them, so that a drain that ran out of time can cut them.
type Caps struct {
	max, maxPerIP int // 0: no cap
	mu            sync.Mutex
	open          int
	perIP         map[netip.Addr]int
	conns         map[*Conn]struct{}
}

// NewCaps caps the open client connections at max in all and maxPerIP
// per client address (0: no cap).
func NewCaps(max, maxPerIP int) *Caps {
	return &Caps{max: max, maxPerIP: maxPerIP, perIP: map[netip.Addr]int{}}
}

func (cc *Caps) track(c *Conn) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.conns == nil {
		cc.conns = map[*Conn]struct{}{}
	}
	cc.conns[c] = struct{}{}
}

// CloseAll closes every open client connection.
func (cc *Caps) CloseAll() {
	cc.mu.Lock()
	conns := make([]*Conn, 0, len(cc.conns))
	for c := range cc.conns {
		conns = append(conns, c)
	}
	cc.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// take counts a new connection from ip, or returns the cap it would break
// ("total" or "per_ip").
func (cc *Caps) take(ip netip.Addr) string {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.max > 0 && cc.open >= cc.max {
		return "total"
	}
	if cc.maxPerIP > 0 {
		if cc.perIP[ip] >= cc.maxPerIP {
			return "per_ip"
		}
		cc.perIP[ip]++
	}
	cc.open++
	return ""
}

// release frees the place of a closed connection and forgets it.
func (cc *Caps) release(c *Conn) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	delete(cc.conns, c)
	cc.open--
	if cc.maxPerIP > 0 {
		if n := cc.perIP[c.IP] - 1; n > 0 {
			cc.perIP[c.IP] = n
		} else {
			delete(cc.perIP, c.IP)
		}
	}
}

func (cc *Caps) Count() int {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	return cc.open
}

// Conn is a client connection with a sliding write deadline (every
// Write must finish within d of its start) and the kernel's receive time of
// the request being read. It embeds *net.TCPConn (through sock.Conn) so that
// SyscallConn, used to watch for a closed peer and to read TCP_INFO, stays
// available.
type Conn struct {
	*sock.Conn
	d     time.Duration
	setAt time.Time // when the deadline was last moved
	// idle is how long a connection given back to the server (resumedIdle)
	// waits for its next request: the server serves it as a new
	// connection, whose first byte it would wait for only its read
	// timeout, but to the client it is a kept-alive one, told the idle
	// timeout. Once its first byte came, the request has read (the read
	// timeout) from then, as on any kept-alive connection.
	idle, read time.Duration

	reqRx int64 // kernel receive time of the first read of the next request

	// The header of the next request is being read (from the connection's
	// start, and again once a response ended) until its blank line: a
	// header block ended by bare LFs, which fasthttp would wait on until
	// the read timeout, is answered 400 at once (ErrBareLF). head holds
	// its last bytes, for a blank line split across reads.
	inHead bool
	bareLF bool
	head   [3]byte
	headN  int

	// Wire is what the connection keeps of its delivery for the
	// measurement: bytes written, the writes that waited for the client
	// (each that took longer than stallMin, whole, and each wait of a relay
	// loop for writability), TCP_INFO when accepted and when closed.
	measure.Wire
	// limited: the socket holds at most MaxUnsent bytes unsent (Streaming).
	limited bool

	caps   *Caps
	closed atomic.Bool

	// pending is what the server had read ahead of a response tokentap
	// wrote itself (a pipelined request), handed back with the connection
	// (takeBuffered); reads return it first. While draining, a read
	// returns errDrained instead of reading the socket. Only the
	// connection's serving goroutine touches them.
	pending  []byte
	draining bool
	// handover is held from a response that takes the connection over
	// (servePass) until the server's goroutine that served it has let go
	// of it (its StateHijacked: Proxy.connState), so that the server is
	// given it back (Proxy.resume) only once nothing of the old serving
	// remains (its idle-tracking entry is keyed by the connection).
	handover sync.WaitGroup
	handing  atomic.Bool
	// resumedIdle: given back to the server (Proxy.resume) and no byte of
	// a next request read since; a shutdown claims it (closeIdleResumed)
	// rather than wait for the server, which counts a connection it is
	// given as busy for its first 5 s.
	resumedIdle atomic.Bool

	// While a relay loop holds the descriptor (looped), Close only shuts
	// the socket down, which ends the loop's stream, and the close itself
	// happens when the stream leaves the loop (closeLater).
	loopMu     sync.Mutex
	looped     bool
	closeLater bool

	// proto: what the first read said the connection speaks (h2.go);
	// h2w the writes of an HTTP/2 connection, which its streams wait on.
	proto uint8
	h2w   h2Writes

	// seat is the socket's place in a relay loop's watch set, from its
	// first request's peer watch until it closes (Watch).
	seat relayplane.Seat
}

// NewConn wraps c, an accepted connection, with a write timeout of d and
// no caps: a connection made apart from a Listener (the relay's
// benchmarks).
func NewConn(c *sock.Conn, d time.Duration) *Conn {
	cc := &Conn{Conn: c, d: d, inHead: true}
	cc.AckBase = -1
	return cc
}

// WriteTimeout is the bound on each write to the client.
func (c *Conn) WriteTimeout() time.Duration { return c.d }

// Seat is the socket's place in a relay loop's watch set.
func (c *Conn) Seat() *relayplane.Seat { return &c.seat }

// HandOver marks the connection as handed over for a response tokentap
// writes itself: it is given back to the server (Resume) only once the
// server's goroutine that served it has let go of it (HandedOver).
func (c *Conn) HandOver() {
	c.handing.Store(true)
	c.handover.Add(1)
}

// HandedOver is told that the server let go of the connection (its
// StateHijacked).
func (c *Conn) HandedOver() {
	if c.handing.CompareAndSwap(true, false) {
		c.handover.Done()
	}
}

// Resume waits until the server let go of a connection handed over, and
// marks it idle unless bytes of a next request were read ahead: it is to
// be served again.
func (c *Conn) Resume() {
	c.handover.Wait()
	c.resumedIdle.Store(len(c.pending) == 0)
}

// ClaimIdle takes a connection given back to the server that has read no
// byte of a next request since (a shutdown closes it rather than wait).
func (c *Conn) ClaimIdle() bool { return c.resumedIdle.CompareAndSwap(true, false) }

// Pending is what the server had read ahead of a response tokentap wrote
// itself, handed back with the connection (TakeBuffered).
func (c *Conn) Pending() []byte { return c.pending }

// EnterLoop marks the connection as held by a relay loop; false if it was
// closed already.
func (c *Conn) EnterLoop() bool {
	c.loopMu.Lock()
	defer c.loopMu.Unlock()
	c.looped = !c.closed.Load()
	return c.looped
}

// LeaveLoop ends the loop's hold, and makes a close that came meanwhile.
func (c *Conn) LeaveLoop() {
	c.loopMu.Lock()
	later := c.closeLater
	c.looped, c.closeLater = false, false
	c.loopMu.Unlock()
	if later {
		_ = c.Close()
	}
}

// Close closes the connection and frees its place under the caps, once.
func (c *Conn) Close() error {
	c.loopMu.Lock()
	if c.looped {
		c.closeLater = true
		c.loopMu.Unlock()
		sock.Shutdown(c)
		return nil
	}
	c.loopMu.Unlock()
	if c.closed.Swap(true) {
		return nil
	}
	c.seat.Leave() // before the descriptor's number can name another socket
	if c.proto == protoH2 {
		c.h2w.close()
	}
	c.Closing()
	err := c.Conn.Close()
	if c.caps != nil {
		c.caps.release(c)
	}
	return err
}

func (c *Conn) Read(b []byte) (int, error) { return c.readPlain(b, (*socketSide)(c)) }

// readPlain reads the plain text of the connection from src (the socket,
// or the TLS layer over it): first what the server had read ahead and
// handed back, then src, following the request header being read.
func (c *Conn) readPlain(b []byte, src io.Reader) (int, error) {
	if c.draining {
		return 0, errDrained
	}
	if c.bareLF {
		return 0, ErrBareLF
	}
	if len(c.pending) > 0 {
		// Read, stamped and scanned when the server read it ahead.
		n := copy(b, c.pending)
		if c.pending = c.pending[n:]; len(c.pending) == 0 {
			c.pending = nil
		}
		return n, nil
	}
	n, err := src.Read(b)
	if c.proto == protoUnknown && n > 0 {
		c.proto = protoHTTP1
		if prefaceStart(b[:n]) {
			return c.sniffH2(b, n, err, src)
		}
	}
	if n > 0 && c.resumedIdle.Load() {
		c.resumedIdle.Store(false)
		if c.read > 0 {
			_ = c.TCPConn.SetReadDeadline(time.Now().Add(c.read))
		}
	}
	if n > 0 && c.inHead {
		c.scanHead(b[:n])
	}
	return n, err
}

// socketSide reads the client's socket, stamping the first read of each
// request with its kernel receive time.
type socketSide Conn

func (s *socketSide) Read(b []byte) (int, error) {
	c := (*Conn)(s)
	n, err := c.Conn.Read(b)
	if n > 0 && c.reqRx == 0 {
		c.reqRx = c.Rx()
	}
	if n > 0 && c.proto == protoH2 {
		c.h2w.rx.Store(c.Rx())
	}
	return n, err
}

// TakeBuffered moves into c's pending bytes what the server had read of
// the connection and not parsed yet (a pipelined request), from hj, the
// hijacked connection, which reads through the server's read buffer: once
// that is empty, its next read would read c, which answers errDrained
// instead. buf is room for the copy.
func (c *Conn) TakeBuffered(hj net.Conn, buf []byte) {
	c.draining = true
	for {
		n, err := hj.Read(buf)
		c.pending = append(c.pending, buf[:n]...)
		if err != nil || n == 0 {
			break
		}
	}
	c.draining = false
}

// errDrained: the server's read buffer of a hijacked connection is empty
// (takeBuffered).
var errDrained = errors.New("the read-ahead buffer is empty")

// ErrBareLF: a request's header block ended with bare line feeds.
var ErrBareLF = errors.New("the request header ends with bare LF line ends")

var (
	crlfcrlf = []byte("\r\n\r\n")
	lflf     = []byte("\n\n")
)

// scanHead follows the header being read: its blank line ends it; an
// "\n\n" first is a header ended with bare LFs (in a CRLF header, "\n\n"
// never occurs).
func (c *Conn) scanHead(b []byte) {
	// The seam with the previous read first.
	var seam [6]byte
	k := copy(seam[:], c.head[:c.headN])
	k += copy(seam[k:], b[:min(len(b), 3)])
	end, bare := bytes.Index(seam[:k], crlfcrlf), bytes.Index(seam[:k], lflf)
	if end < 0 && bare < 0 {
		end, bare = bytes.Index(b, crlfcrlf), bytes.Index(b, lflf)
	}
	switch {
	case bare >= 0 && (end < 0 || bare < end):
		c.bareLF, c.inHead = true, false
	case end >= 0:
		c.inHead = false
	default:
		c.headN = copy(c.head[:], b[max(len(b)-3, 0):])
		if len(b) < 3 {
			c.headN = copy(c.head[:], seam[max(k-3, 0):k])
		}
	}
}

// Streaming says whether the response about to be written is a token
// stream: its socket then holds at most MaxUnsent bytes unsent
// (sock.LimitUnsent), so a client that takes its tokens late holds the
// writes back and is seen to; a body relayed whole is written into the
// socket's whole buffer (the limit cost a 32 MiB body a third of its
// loopback throughput: BenchmarkBulkBody). A syscall only when it changes.
func (c *Conn) Streaming(on bool) {
	if on == c.limited || c.Sys == nil {
		return
	}
	n := 0 // the system's default (net.ipv4.tcp_notsent_lowat)
	if on {
		n = MaxUnsent
	}
	if sock.LimitUnsent(c.Sys, n) == nil {
		c.limited = on
	}
}

// ExpectHead says the next bytes read begin a request's header (a
// response ended).
func (c *Conn) ExpectHead() { c.inHead, c.headN = true, 0 }

// Arrival returns when the request being served began to arrive, and makes
// the next read start the next request. A request that came in with the
// previous one's bytes (pipelined) has no stamp of its own and gets now.
func (c *Conn) Arrival(now time.Time, maxAge time.Duration) time.Time {
	rx := c.reqRx
	c.reqRx = 0
	return sock.Received(rx, now, maxAge)
}

// SetReadDeadline sets the read deadline; for the server's wait for the
// first byte of a connection given back (resumedIdle), the idle wait
// instead of the read timeout it asks for.
func (c *Conn) SetReadDeadline(t time.Time) error {
	if !t.IsZero() && c.idle > 0 && c.resumedIdle.Load() {
		t = time.Now().Add(c.idle)
	}
	return c.TCPConn.SetReadDeadline(t)
}

// stallMin is the shortest write counted as waiting for the client: one
// that does not wait takes microseconds (a loopback write, which also runs
// the receiver's side of TCP, up to some tens).
const stallMin = 500 * time.Microsecond
