package downstream

import (
	"context"
	"net"
	"sync"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// Cancel ties the exchange's upstream connection to the peer watch:
// when the client goes, the connection is closed, which interrupts any
// read or write on it and cancels the request at the backend; a request
// waiting for admission sees done closed.
type Cancel struct {
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

// Settle marks the upstream's response as ended, before its last bytes go
// to the client: from here on a client that leaves (having read it all,
// most often) cancels nothing, and its departure neither closes the
// upstream connection, which goes back to the pool, nor makes the record a
// client cancel. A departure before it is a cancel, as before.
func (c *Cancel) Settle() {
	c.mu.Lock()
	c.settled = true
	c.mu.Unlock()
}

// EnterLoop marks the connection as held by a relay loop; false if the
// client has gone already.
func (c *Cancel) EnterLoop() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.looped = !c.gone
	return c.looped
}

func (c *Cancel) LeaveLoop() {
	c.mu.Lock()
	c.looped = false
	c.mu.Unlock()
}

// Done returns a channel closed when the client has gone.
func (c *Cancel) Done() <-chan struct{} {
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

// Attach makes conn the one to close on cancel; false if already cancelled.
func (c *Cancel) Attach(conn net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gone {
		return false
	}
	c.conn = conn
	return true
}

func (c *Cancel) Detach() {
	c.mu.Lock()
	c.conn = nil
	c.mu.Unlock()
}

// Fire is called by the peer watch (or the relay loop) when the client
// has gone.
func (c *Cancel) Fire() {
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

func (c *Cancel) IsGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone
}

// Context returns a context done when the client has gone: a wait for
// admission, or a dial, ends with it. It holds only the channel (made now,
// on the owner's goroutine): what the context package starts to watch it
// never touches the Cancel, which lives in a pooled exchange.
func (c *Cancel) Context() context.Context { return goneCtx{c.Done()} }

// goneCtx is a context done when its channel is closed.
type goneCtx struct{ done <-chan struct{} }

func (goneCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c goneCtx) Done() <-chan struct{}     { return c.done }
func (goneCtx) Value(any) any               { return nil }
func (c goneCtx) Err() error {
	select {
	case <-c.done:
		return context.Canceled
	default:
		return nil
	}
}
