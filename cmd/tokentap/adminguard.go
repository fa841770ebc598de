package main

import (
	"net"
	"net/netip"
	"strings"
	"sync"

	"github.com/valyala/fasthttp"
)

// The admin listener's connection caps. Probes and scrapes keep a budget
// of their own past the caps, so that clients that hold connections open
// (half-sent requests) cannot make /healthz, /readyz or /metrics fail.
const (
	adminConnsPerIP   = 16 // connections from one address, any endpoint
	adminConns        = 64 // connections in all, any endpoint
	adminProbeConns   = 4  // more per address, for probes and scrapes only
	adminProbeConnsIn = 16 // more in all, for probes and scrapes only
)

// probePaths are the endpoints a probe-only connection may ask for.
func probePath(path string) bool {
	return path == "/healthz" || path == "/readyz" || path == "/metrics"
}

// adminListener accepts the admin listener's connections under the caps:
// beyond adminConnsPerIP (or adminConns in all) a connection is accepted
// as probe-only, beyond the probe budget it is closed at once.
type adminListener struct {
	net.Listener
	mu     sync.Mutex
	perIP  map[netip.Addr]int
	total  int
	probes int
}

// adminConn is one accepted connection; probeOnly ones serve probePath
// endpoints only.
type adminConn struct {
	net.Conn
	l         *adminListener
	ip        netip.Addr
	probeOnly bool
	once      sync.Once
}

func newAdminListener(l net.Listener) *adminListener {
	return &adminListener{Listener: l, perIP: map[netip.Addr]int{}}
}

func (l *adminListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		var ip netip.Addr
		if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			ip = ta.AddrPort().Addr().Unmap()
		}
		l.mu.Lock()
		n := l.perIP[ip]
		probeOnly := false
		switch {
		case n < adminConnsPerIP && l.total < adminConns:
		case n < adminConnsPerIP+adminProbeConns && l.probes < adminProbeConnsIn:
			probeOnly = true
			l.probes++
		default:
			l.mu.Unlock()
			c.Close()
			continue
		}
		l.perIP[ip] = n + 1
		if !probeOnly {
			l.total++
		}
		l.mu.Unlock()
		return &adminConn{Conn: c, l: l, ip: ip, probeOnly: probeOnly}, nil
	}
}

func (c *adminConn) Close() error {
	c.once.Do(func() {
		l := c.l
		l.mu.Lock()
		if l.perIP[c.ip]--; l.perIP[c.ip] <= 0 {
			delete(l.perIP, c.ip)
		}
		if c.probeOnly {
			l.probes--
		} else {
			l.total--
		}
		l.mu.Unlock()
	})
	return c.Conn.Close()
}

// probeOnly says whether ctx came on a connection past the caps.
func probeOnly(ctx *fasthttp.RequestCtx) bool {
	c, ok := ctx.Conn().(*adminConn)
	return ok && c.probeOnly
}

// hostAllowed says whether a request without a token names this listener
// in its Host: an IP literal, localhost, or a name of hosts. A page that
// rebinds its own name to the listener's address sends its own name, so a
// browser can neither read the admin endpoints nor call them that way.
func hostAllowed(host string, hosts []string) bool {
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	name = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSuffix(name, "]"), "["), ".")
	if name == "" {
		return false
	}
	if _, err := netip.ParseAddr(name); err == nil {
		return true
	}
	name = strings.ToLower(name)
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		return true
	}
	for _, h := range hosts {
		if strings.EqualFold(h, name) {
			return true
		}
	}
	return false
}

// crossSite says whether a state-changing call without a token comes
// from another site's page: an Origin that is not the Host it was sent
// to, a browser's Sec-Fetch-Site that is not same-origin, or a body type
// an HTML form can send without asking (a CORS "simple" request). curl's
// POST carries none of these.
func crossSite(ctx *fasthttp.RequestCtx) bool {
	h := &ctx.Request.Header
	if o := h.Peek("Origin"); len(o) > 0 {
		host := string(o)
		if i := strings.Index(host, "://"); i >= 0 {
			host = host[i+3:]
		}
		if !strings.EqualFold(host, string(h.Host())) {
			return true
		}
	}
	if s := string(h.Peek("Sec-Fetch-Site")); s != "" && s != "same-origin" && s != "none" {
		return true
	}
	ct := strings.ToLower(strings.TrimSpace(string(h.ContentType())))
	ct, _, _ = strings.Cut(ct, ";")
	switch strings.TrimSpace(ct) {
	case "application/x-www-form-urlencoded", "multipart/form-data", "text/plain":
		return true
	}
	return false
}
