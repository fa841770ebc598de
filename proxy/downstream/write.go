package downstream

import "time"

// Write moves the deadline to d from now, unless it was moved less than
// 1% of d ago (a burst of writes then shares one deadline, which is at most
// 1% shorter than d). A write the measurement asked to split (Wire.Split)
// may go out as two segments: see writeSplit.
func (c *Conn) Write(b []byte) (int, error) {
	if c.Split {
		c.Split = false
		return c.writeSplit(b)
	}
	return c.write(b)
}

func (c *Conn) write(b []byte) (int, error) {
	now := time.Now()
	if now.Sub(c.setAt) > c.d/100 {
		if err := c.TCPConn.SetWriteDeadline(now.Add(c.d)); err != nil {
			return 0, err
		}
		c.setAt = now
	}
	if c.proto == protoH2 {
		c.h2w.started()
	}
	n, err := c.Conn.Write(b)
	c.Sent += int64(n)
	if d := time.Since(now); d > stallMin {
		c.Stall += d
	}
	if c.proto == protoH2 {
		c.h2w.ended(c.Sent)
	}
	return n, err
}

// writeSplit writes b, which carries a response's first token, as two
// segments: its first byte, and the rest (the connection has no delay:
// TCP_NODELAY). The measurement asks for it only when the client had
// acknowledged every byte written before, the kernel held none unsent and
// the client's window was open (ClientSide.SplitFirst), so the first
// byte leaves at once, alone. A client that keeps its connection alive
// acknowledges a lone small segment late (Linux's delayed
// acknowledgement in its interactive mode waits for a second segment and
// its application's read, or for its timer; other systems acknowledge
// every second segment): one that holds none of ours unacknowledged
// acknowledges the second of two as it reads it, so the acknowledgement
// of this write times the token's arrival (measure's ackMark), where that
// of a lone segment comes with the next write's bytes or the timer's. The
// first byte goes alone, not the last: the token's bytes arrive with the
// end of the write whose acknowledgement is watched. The bytes are the
// same, read in one read or two, as TCP may deliver any write; the second
// segment's reach the client one small packet's time later on the path's
// bottleneck (its headers, about 60 bytes: 5 µs at 100 Mbit/s, 1.8 ms at
// 32 KiB/s). Wire.SplitAt keeps the connection's count at the end of b; a
// write that failed keeps none.
func (c *Conn) writeSplit(b []byte) (int, error) {
	if len(b) < 2 {
		return c.write(b)
	}
	n, err := c.write(b[:1])
	if err != nil {
		return n, err
	}
	m, err := c.write(b[1:])
	if err == nil {
		c.SplitAt = c.Sent
	}
	return n + m, err
}

// SetDeadline and SetWriteDeadline replace the write deadline (the server
// clears it when it hands a connection over), so the next Write sets its
// own again.
func (c *Conn) SetDeadline(t time.Time) error {
	c.setAt = time.Time{}
	return c.TCPConn.SetDeadline(t)
}

func (c *Conn) SetWriteDeadline(t time.Time) error {
	c.setAt = time.Time{}
	return c.TCPConn.SetWriteDeadline(t)
}
