package proxy

import (
	"net"
	"sync"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// cancelState ties the exchange's upstream connection to the peer watch:
// when the client goes, the connection is closed, which interrupts any
// read or write on it and cancels the request at the backend; a request
// waiting for admission sees done closed.
type cancelState struct {
	mu   sync.Mutex
	gone bool
	conn net.Conn
	done chan struct{}
	// looped: a relay loop holds the connection's descriptor, so fire
	// only shuts the socket down; the exchange closes it after the loop.
	looped bool
	// settled: the upstream's response has ended; a client that leaves
	// after it cancels nothing (see settle).
	settled bool
}

// settle marks the upstream's response as ended, before its last bytes go
// to the client: from here on a client that leaves (having read it all,
// most often) cancels nothing, and its departure neither closes the
// upstream connection, which goes back to the pool, nor makes the record a
// client cancel. A departure before it is a cancel, as before.
func (c *cancelState) settle() {
	c.mu.Lock()
	c.settled = true
	c.mu.Unlock()
}

// enterLoop marks the connection as held by a relay loop; false if the
// client has gone already.
func (c *cancelState) enterLoop() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.looped = !c.gone
	return c.looped
}

func (c *cancelState) leaveLoop() {
	c.mu.Lock()
	c.looped = false
	c.mu.Unlock()
}

// doneChan returns a channel closed when the client has gone.
func (c *cancelState) doneChan() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.gone {
			close(c.done)
		}
	}
	return c.done
}

// attach makes conn the one to close on cancel; false if already cancelled.
func (c *cancelState) attach(conn net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone {
		return false
	}
	c.conn = conn
	return true
}

func (c *cancelState) detach() {
	c.mu.Lock()
	c.conn = nil
	c.mu.Unlock()
}

// fire is called by the peer watch (or the relay loop) when the client
// has gone.
func (c *cancelState) fire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.settled {
		return
	}
	if !c.gone && c.done != nil {
		close(c.done)
	}
	c.gone = true
	switch {
	case c.conn == nil:
	case c.looped:
		sock.Shutdown(c.conn) // the loop ends the stream; finish closes the connection
	default:
		_ = c.conn.Close()
	}
}

func (c *cancelState) isGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone
}
