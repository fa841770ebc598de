// Package upstream is the relay's side towards the backends: a backend
// address with its pool of keep-alive connections (Backend, Pool), each
// connection checked before reuse and stamped by the kernel (Conn), the
// request sent on one and sent again only where the backend provably never
// received it (RoundTrip, MayResend), the upstream request built from the
// client's (Prepare: hop-by-hop headers dropped, credentials set), and how
// https backends are trusted (TLS). It knows nothing of routes or
// exchanges.
package upstream

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/admission/shed"
	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// Backend is one backend address with its own small pool of keep-alive
// connections.
//
// tokentap keeps this pool instead of using fasthttp.HostClient because a
// request must be abortable at any moment, above all while the backend is
// still prefilling and no response byte has arrived: HostClient.Do gives no
// handle on the connection it uses, so nothing could interrupt it. Here the
// exchange owns its connection, and closing it cancels the request at the
// backend. HTTP/1.1 framing still comes from fasthttp (Request.Write,
// Response.Read with StreamBody).
type Backend struct {
	scheme   string
	addr     string // host:port to dial
	host     string // Host header sent upstream
	basePath string // path prefix of the upstream URL, without trailing slash
	// auth is "Basic …" from the URL's user:password@, sent as this
	// upstream's Authorization instead of the client's ("": none). It is
	// never logged: errors and logs show the URL redacted (redactURL).
	auth string
	// headers are set on every request sent to it (credentials.go):
	// never logged.
	headers []Header
	tls     *tls.Config
	// fwd is the forward proxy the environment names for this upstream
	// (HTTPS_PROXY, HTTP_PROXY, NO_PROXY), reached at fwdAddr: the
	// upstream is reached through a CONNECT tunnel. Nil: directly.
	fwd     *url.URL
	fwdAddr string
	dialer  net.Dialer
	t       Timeouts
	now     func() time.Time
	h2c     bool // spoken to in HTTP/2 with prior knowledge (h2c.go)

	// Pool holds the connections, counts and what was learned of the
	// backend; the upstreams of successive configurations that reach the
	// same backend the same way share it (Proxy.pools), so that
	// max_conns counts across a reload and no connection is left in the
	// pool of a configuration no request uses any more.
	*Pool
}

// Pool is the connections of a route's upstream, kept across the
// configurations that reach its backend the same way (scheme, address,
// Host, TLS settings, forward proxy: poolKey).
type Pool struct {
	mu      sync.Mutex
	idle    []*Conn // LIFO: the longest idle first
	open    int     // connections open, idle or busy
	reaping bool    // a reap is scheduled (only while connections are idle)
	retired bool    // no configuration reaches the backend this way any more: connections close as they come back

	// inflight is the requests sent to the upstream and not finished, from
	// every configuration's exchanges; gate predicts what a new one would
	// live there (overload control).
	Inflight atomic.Int64
	Gate     *shed.Gate

	// afterStream is what the backend was seen to do with a connection
	// once a response of unknown length (a stream) ended on it: some
	// (llama.cpp's server) announce keep-alive and close it right after,
	// a race with the next request sent on it. Until it is known, such a
	// connection is reused only streamSettle after that end; once the
	// backend was seen to close one, they are closed instead of pooled;
	// once it was seen keeping streamKeptToTrust of them, they are pooled
	// as any other.
	afterStream atomic.Int32 // StreamUnknown, StreamCloses or StreamKeeps
	streamsKept atomic.Int32

	// h2 is an h2c backend's transport (h2c.go), made on its first
	// request.
	h2Once sync.Once
	h2     *http.Transport
}

// What a backend does with a connection after a streamed response
// (AfterStream).
const (
	StreamUnknown int32 = iota
	StreamCloses
	StreamKeeps
)

// streamSettle is how long after a streamed response a connection waits
// before reuse while the backend's habit is unknown: llama.cpp's server
// closes within a millisecond of the end (its FIN came 0.2–0.5 ms after
// the next request, sent within 0.5 ms of the end).
const streamSettle = 5 * time.Millisecond

// streamKeptToTrust is how many connections reused after a stream make a
// backend one that keeps them.
const streamKeptToTrust = 3

// New makes the backend at rawURL (http or https, a base path allowed),
// reached within t, on the clock now, trusted by rtls (nil: the system's
// roots).
func New(rawURL string, t Timeouts, now func() time.Time, rtls *TLS) (*Backend, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, urlError(err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("scheme must be http or https, not %q", u.Scheme)
	}
	if u.Host == "" {
		return nil, errors.New("missing host")
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return nil, errors.New("must not have a query or fragment")
	}
	up := &Backend{scheme: u.Scheme, host: u.Host, addr: u.Host, t: t, now: now, Pool: &Pool{Gate: shed.New(now)}}
	if u.User != nil {
		pass, _ := u.User.Password()
		up.auth = "Basic " + base64.StdEncoding.EncodeToString([]byte(u.User.Username()+":"+pass))
	}
	if u.Port() == "" {
		if u.Scheme == "https" {
			up.addr = net.JoinHostPort(u.Hostname(), "443")
		} else {
			up.addr = net.JoinHostPort(u.Hostname(), "80")
		}
	}
	up.basePath = trimSlash(u.EscapedPath())
	if u.Scheme == "https" {
		c, err := upstreamTLSConfig(u.Hostname(), rtls)
		if err != nil {
			return nil, err
		}
		up.tls = c
	}
	fwd, err := proxyFor(u.Scheme, up.addr)
	if err != nil {
		return nil, fmt.Errorf("the forward proxy the environment names: %w", urlError(err))
	}
	if fwd != nil {
		if fwd.Scheme != "http" {
			return nil, errors.New("the forward proxy the environment names must be an http:// proxy")
		}
		up.fwd, up.fwdAddr = fwd, fwd.Host
		if fwd.Port() == "" {
			up.fwdAddr = net.JoinHostPort(fwd.Hostname(), "80")
		}
	}
	up.dialer = net.Dialer{Timeout: t.Connect, KeepAlive: 30 * time.Second,
		Control: func(_, _ string, raw syscall.RawConn) error {
			// Best effort: without stamps, reads are stamped when they return.
			_ = sock.EnableRxStamps(raw)
			return nil
		}}
	return up, nil
}

// UseH2C makes the backend speak h2c (h2c.go). It needs an http:// URL
// reached directly.
func (up *Backend) UseH2C() error {
	switch {
	case up.scheme != "http":
		return errors.New("protocol h2c needs an http:// url (h2c is HTTP/2 in plain text)")
	case up.fwd != nil:
		return errors.New("protocol h2c: the forward proxy the environment names cannot carry it (add the backend to NO_PROXY)")
	}
	up.h2c = true
	return nil
}

// RedactURL is an upstream URL as errors and logs may show it: without
// its password, and without the text of a URL that does not parse (it
// could hold one).
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(an unparsable URL)"
	}
	return u.Redacted()
}

// urlError is err without the URL url.Parse quotes in it.
func urlError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

func trimSlash(s string) string {
	for len(s) > 0 && s[len(s)-1] == '/' {
		s = s[:len(s)-1]
	}
	return s
}

// maxRxAge bounds how long bytes can have waited in an upstream socket for
// their receive timestamp to be believed (a guard against a stepped clock).
const maxRxAge = time.Minute

// Get returns an idle connection that is still open and quiet, or dials a
// new one; fresh skips the pool.
//
// Every pooled connection is looked at before reuse (one non-consuming
// peek, no allocation): one the backend closed is replaced, and one with
// bytes waiting is closed unread. Such bytes can only be a response to no
// request (a backend that answered more than it was asked, or miscounted
// a body): read as the next request's response they would hand one user
// another's answer.
func (up *Backend) Get(ctx context.Context, fresh bool) (*Conn, error) {
	now := up.now()
	up.mu.Lock()
	for !fresh && len(up.idle) > 0 {
		c := up.idle[len(up.idle)-1]
		up.idle = up.idle[:len(up.idle)-1]
		// The connection is this request's from here: the peek, a system
		// call, is made outside the lock the other requests wait on.
		up.mu.Unlock()
		state := sock.PeerUnknown
		if c.usable(now) {
			state = c.peek()
			if c.streamEnded {
				state = up.settle(c, state)
			}
		}
		if state == sock.PeerIdle {
			c.up = up // pooled by an earlier configuration's upstream, maybe: its timeouts are now up's
			c.reused = true
			if c.usesLeft > 0 {
				c.usesLeft--
			}
			return c, nil
		}
		up.mu.Lock()
		up.open--
		up.mu.Unlock()
		switch state {
		case sock.PeerData:
			metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
		case sock.PeerClosed:
			metrics.UpstreamConnDiscarded(metrics.DiscardClosedByPeer)
		default:
			metrics.UpstreamConnDiscarded(metrics.DiscardExpired)
		}
		_ = c.Conn.Close()
		up.mu.Lock()
	}
	if up.t.MaxConns > 0 && up.open >= up.t.MaxConns {
		up.mu.Unlock()
		return nil, ErrTooManyConns
	}
	up.open++
	up.mu.Unlock()
	c, err := up.dial(ctx)
	if err != nil {
		up.mu.Lock()
		up.open--
		up.mu.Unlock()
		return nil, err
	}
	return c, nil
}

// settle looks at a connection whose last response was a stream while
// the backend's habit is unknown: it waits until streamSettle after that
// end for the backend's close, and learns from what it finds.
func (up *Backend) settle(c *Conn, state sock.PeerState) sock.PeerState {
	if state == sock.PeerIdle {
		if wait := streamSettle - up.now().Sub(c.lastUsed); wait > 0 {
			time.Sleep(wait)
			state = c.peek()
		}
	}
	switch state {
	case sock.PeerClosed:
		up.afterStream.CompareAndSwap(StreamUnknown, StreamCloses)
	case sock.PeerIdle:
		if up.streamsKept.Add(1) >= streamKeptToTrust {
			up.afterStream.CompareAndSwap(StreamUnknown, StreamKeeps)
		}
	}
	c.streamEnded = false
	return state
}

var (
	// ErrCancelled: the client left while its request was being sent.
	ErrCancelled     = errors.New("client closed the connection")
	ErrTooManyConns  = errors.New("upstream connection limit reached")
	ErrWriteUpstream = errors.New("cannot write the request upstream")
	ErrReadUpstream  = errors.New("cannot read the upstream response")
)

func (up *Backend) dial(ctx context.Context) (*Conn, error) {
	target := up.addr
	if up.fwd != nil {
		target = up.fwdAddr
	}
	conn, err := up.dialer.DialContext(ctx, "tcp", target)
	if err != nil {
		return nil, err
	}
	var rx *sock.Conn
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
		rx = sock.NewConn(tc, true)
		conn = rx
	}
	if up.fwd != nil {
		cctx, cancel := context.WithTimeout(ctx, up.t.Connect)
		err = connectThrough(cctx, conn, up.fwd, up.addr)
		cancel()
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
	}
	if up.tls != nil {
		tc := tls.Client(conn, up.tls)
		hctx, cancel := context.WithTimeout(ctx, up.t.Connect)
		err = tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			_ = conn.Close()
			return nil, err
		}
		conn = tc
	}
	c := &Conn{Conn: conn, up: up, rx: rx, usesLeft: -1}
	c.br = newUpReader(c)
	if up.tls == nil {
		// The kernel's count of acknowledged bytes starts with the SYN:
		// read it once, as the connection opens (see ackedBefore).
		c.ackBase = c.BytesAcked()
	}
	return c, nil
}

// Wrap makes c, a connection made apart from the pool (the relay's
// benchmarks), one of up's: its reads bounded by the idle timeout, and
// stamped by the kernel (a relay loop can take it) when stamped.
func (up *Backend) Wrap(c *sock.Conn, stamped bool) *Conn {
	uc := &Conn{Conn: c, up: up, usesLeft: -1, timeout: up.t.Idle}
	if stamped {
		uc.rx = c
	}
	uc.br = newUpReader(uc)
	return uc
}

// Put returns a connection whose last response was read completely
// (streamed: a response of unknown length, ended by its framing). A
// connection with bytes read past the end of that response is closed
// instead: the response did not end at a message boundary; so is one after
// a stream from a backend that closes those (Backend.afterStream).
func (up *Backend) Put(c *Conn, streamed bool) {
	if c.br.Buffered() > 0 {
		metrics.UpstreamConnDiscarded(metrics.DiscardStrayBytes)
		up.Discard(c)
		return
	}
	c.streamEnded = false
	if streamed {
		switch up.afterStream.Load() {
		case StreamCloses:
			metrics.UpstreamConnDiscarded(metrics.DiscardAfterStream)
			up.Discard(c)
			return
		case StreamUnknown:
			c.streamEnded = true
		}
	}
	if c.usesLeft == 0 {
		metrics.UpstreamConnDiscarded(metrics.DiscardExpired)
		up.Discard(c)
		return
	}
	c.timeout = 0
	c.setFor = 0
	c.armed = false
	c.first = time.Time{}
	c.readAt = time.Time{}
	c.reused = false
	// The read deadline is left as it is: nothing reads an idle connection
	// (get peeks without it), and the next Read moves it (setFor is 0).
	c.lastUsed = up.now()
	up.mu.Lock()
	if len(up.idle) < up.t.MaxIdleConns && !up.retired {
		up.idle = append(up.idle, c)
		if !up.reaping && up.t.IdleConn > 0 {
			up.reaping = true
			time.AfterFunc(up.t.IdleConn, up.reap)
		}
		up.mu.Unlock()
		return
	}
	up.mu.Unlock()
	up.Discard(c)
}

// reap closes the connections idle for longer than IdleConn, so that their
// descriptors, and the backend's, do not wait for the next request to be
// found expired. It is scheduled only while connections are idle: an idle
// proxy with an empty pool runs no timer.
func (up *Backend) reap() {
	now := up.now()
	up.mu.Lock()
	n := 0
	for n < len(up.idle) && now.Sub(up.idle[n].lastUsed) >= up.t.IdleConn {
		n++
	}
	expired := slices.Clone(up.idle[:n])
	up.idle = slices.Delete(up.idle, 0, n)
	up.open -= n
	if len(up.idle) > 0 {
		time.AfterFunc(up.idle[0].lastUsed.Add(up.t.IdleConn).Sub(now), up.reap)
	} else {
		up.reaping = false
	}
	up.mu.Unlock()
	for _, c := range expired {
		_ = c.Conn.Close()
	}
}

// Discard closes a connection that must not be reused: its response was not
// read to the end, or the exchange was cancelled.
func (up *Backend) Discard(c *Conn) {
	_ = c.Conn.Close()
	up.mu.Lock()
	up.open--
	up.mu.Unlock()
}

// Addr is the host:port up dials (its forward proxy's aside).
func (up *Backend) Addr() string { return up.addr }

// SetHeaders sets the headers every request to up carries (its
// credentials).
func (up *Backend) SetHeaders(h []Header) { up.headers = h }

// UsePool has up take over p, the connections of an earlier
// configuration's backend that reaches it the same way (PoolKey), with
// their counts and what was learned of the backend.
func (up *Backend) UsePool(p *Pool) { up.Pool = p }

// Counts returns the open and idle connections of up's pool.
func (up *Backend) Counts() (open, idle int) {
	up.mu.Lock()
	defer up.mu.Unlock()
	return up.open, len(up.idle)
}

// AfterStream is what the backend was seen to do with a connection after
// a streamed response: StreamUnknown, StreamCloses or StreamKeeps.
func (up *Backend) AfterStream() int32 { return up.afterStream.Load() }

// PoolKey says how up reaches its backend: a route's upstream of the next
// configuration with the same key takes its connections over.
func (up *Backend) PoolKey(rtls *TLS) string {
	return fmt.Sprintf("%s|%s|%s|%s|%v|%+v", up.scheme, up.addr, up.host, up.fwdAddr, up.h2c, rtls)
}

// Retire closes the idle connections of a pool no configuration uses any
// more; those in use close when their responses end.
func (p *Pool) Retire() {
	p.mu.Lock()
	p.retired = true
	p.mu.Unlock()
	p.CloseIdle()
}

// CloseIdle closes every idle connection.
func (p *Pool) CloseIdle() {
	up := p
	up.mu.Lock()
	idle := up.idle
	up.idle = nil
	up.open -= len(idle)
	up.mu.Unlock()
	for _, c := range idle {
		_ = c.Conn.Close()
	}
	if p.h2 != nil {
		p.h2.CloseIdleConnections()
	}
}

// smallRequest is the largest body written upstream without a write
// deadline (the kernel's default send buffer is 16 KiB, headers included).
const smallRequest = 8 << 10
