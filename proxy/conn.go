package proxy

import (
	"net"
	"time"
)

// writeDeadlineListener gives each accepted connection a sliding write
// deadline: every Write must finish within d of its start.
type writeDeadlineListener struct {
	net.Listener
	d time.Duration
}

func (l writeDeadlineListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		return &writeDeadlineConn{TCPConn: tc, d: l.d}, nil
	}
	return c, nil
}

// writeDeadlineConn embeds *net.TCPConn so that SyscallConn (used to watch
// for a closed peer and to read TCP_INFO) stays available.
type writeDeadlineConn struct {
	*net.TCPConn
	d     time.Duration
	setAt time.Time // when the deadline was last moved

	rtt   time.Duration // the last TCP_INFO reading, and when it was taken
	rttAt time.Time
}

// RTT returns the kernel's smoothed RTT of the connection, read again at
// most once a second (it changes slowly; the read is a syscall).
func (c *writeDeadlineConn) RTT(now time.Time) time.Duration {
	if c.rttAt.IsZero() || now.Sub(c.rttAt) > time.Second {
		c.rtt, c.rttAt = tcpRTT(c.TCPConn), now
	}
	return c.rtt
}

// Write moves the deadline to d from now, unless it was moved less than
// 1% of d ago (a burst of writes then shares one deadline, which is at most
// 1% shorter than d).
func (c *writeDeadlineConn) Write(b []byte) (int, error) {
	if now := time.Now(); now.Sub(c.setAt) > c.d/100 {
		if err := c.TCPConn.SetWriteDeadline(now.Add(c.d)); err != nil {
			return 0, err
		}
		c.setAt = now
	}
	return c.TCPConn.Write(b)
}
