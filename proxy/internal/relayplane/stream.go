package relayplane

import "time"

// Stream is a stream as a loop sees it. The loop calls its methods on
// its own goroutine only, while the stream is in it.
type Stream interface {
	// Read reads the upstream socket fd once. wait: nothing was waiting
	// (EAGAIN). Otherwise out is what to write to the client (possibly
	// nothing), got says bytes came, again that the socket may still be
	// readable (the buffer filled, or its end waits).
	Read(fd int, events uint32) (out []byte, wait, got, again bool)
	// Written: out was written whole; end says whether the stream is
	// over, err why (nil: the body's end).
	Written() (end bool, err error)
	// Note tells the stream what else befell it (Event).
	Note(e Event)
}

// EventKind is what befell a stream in a loop.
type EventKind uint8

const (
	// Entered: the loop took the stream (its sockets are watched).
	Entered EventKind = iota
	// Sent: N bytes were written to the client.
	Sent
	// Stalled: a write waited D for the client's socket.
	Stalled
	// ClientLeft: the client's socket reported its close with nothing
	// waiting.
	ClientLeft
	// Failed: the stream ends with Err, a failed write, a stop or a
	// timeout; KeepRead says whether the read being relayed keeps its own
	// error (false: Err is the read's, an idle upstream). Ended follows.
	Failed
	// Ended: the loop let go of the stream, for good (Err: how it ended;
	// ErrNoLoop: the loop could not take it). The loop touches neither
	// the stream nor its Handle after it.
	Ended
)

// Event is one thing that befell a stream in a loop, with what its kind
// says (N, D, Err, KeepRead).
type Event struct {
	Kind     EventKind
	KeepRead bool
	N        int
	D        time.Duration
	Err      error
}
