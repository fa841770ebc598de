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
	d time.Duration
}

func (c *writeDeadlineConn) Write(b []byte) (int, error) {
	if err := c.TCPConn.SetWriteDeadline(time.Now().Add(c.d)); err != nil {
		return 0, err
	}
	return c.TCPConn.Write(b)
}
