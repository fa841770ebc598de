package proxy

import (
	"net"
	"time"
)

// clientListener wraps accepted connections in clientConn.
type clientListener struct {
	net.Listener
	d       time.Duration
	stamped bool // receive timestamps are enabled on the listening socket
}

func (l clientListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		return &clientConn{rxConn: newRxConn(tc, l.stamped), d: l.d}, nil
	}
	return c, nil
}

// clientConn is a client connection with a sliding write deadline (every
// Write must finish within d of its start) and the kernel's receive time of
// the request being read. It embeds *net.TCPConn (through rxConn) so that
// SyscallConn, used to watch for a closed peer and to read TCP_INFO, stays
// available.
type clientConn struct {
	*rxConn
	d     time.Duration
	setAt time.Time // when the deadline was last moved

	reqRx int64 // kernel receive time of the first read of the next request

	rtt   time.Duration // the last TCP_INFO reading, and when it was taken
	rttAt time.Time
}

func (c *clientConn) Read(b []byte) (int, error) {
	n, err := c.rxConn.Read(b)
	if n > 0 && c.reqRx == 0 {
		c.reqRx = c.rx
	}
	return n, err
}

// arrival returns when the request being served began to arrive, and makes
// the next read start the next request. A request that came in with the
// previous one's bytes (pipelined) has no stamp of its own and gets now.
func (c *clientConn) arrival(now time.Time, maxAge time.Duration) time.Time {
	rx := c.reqRx
	c.reqRx = 0
	return received(rx, now, maxAge)
}

// RTT returns the kernel's smoothed RTT of the connection, read again at
// most once a second (it changes slowly; the read is a syscall).
func (c *clientConn) RTT(now time.Time) time.Duration {
	if c.rttAt.IsZero() || now.Sub(c.rttAt) > time.Second {
		c.rtt, c.rttAt = tcpRTT(c.TCPConn), now
	}
	return c.rtt
}

// Write moves the deadline to d from now, unless it was moved less than
// 1% of d ago (a burst of writes then shares one deadline, which is at most
// 1% shorter than d).
func (c *clientConn) Write(b []byte) (int, error) {
	if now := time.Now(); now.Sub(c.setAt) > c.d/100 {
		if err := c.TCPConn.SetWriteDeadline(now.Add(c.d)); err != nil {
			return 0, err
		}
		c.setAt = now
	}
	return c.TCPConn.Write(b)
}
