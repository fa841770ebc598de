package relayplane

// spareBufs are a relay loop's spare read buffers. A stream in the loop
// holds one only while a read of it is relayed (until its bytes are
// written, or while a size line cut by the read's end is held) and gives it
// back between events: an idle stream holds none. The loop keeps at most
// maxSpareBufs; it shares more, and takes what it lacks, with every
// stream (NewBuf, PutBuf). Only the loop's goroutine uses them.
type spareBufs struct{ bufs [][]byte }

const maxSpareBufs = 8

// take returns a spare buffer.
func (b *spareBufs) take() []byte {
	n := len(b.bufs)
	if n == 0 {
		return NewBuf()
	}
	v := b.bufs[n-1]
	b.bufs[n-1] = nil
	b.bufs = b.bufs[:n-1]
	return v
}

// give keeps v, a buffer of take's, for a later take.
func (b *spareBufs) give(v []byte) {
	if len(b.bufs) < maxSpareBufs {
		b.bufs = append(b.bufs, v)
		return
	}
	PutBuf(v)
}

// Spares keeps up to its capacity of values for reuse by any goroutine;
// more are left to the collector. Unlike a sync.Pool, which keeps every
// value put until two collections have passed, it does not hold what a
// crowd of open streams let go of: their memory is free again at once,
// and a burst of new streams reuses the values of those that came before.
type Spares[T any] chan T

// Get returns a kept value, if one is.
func (s Spares[T]) Get() (v T, ok bool) {
	select {
	case v = <-s:
		return v, true
	default:
		return v, false
	}
}

// Put keeps v, unless the store is full.
func (s Spares[T]) Put(v T) {
	select {
	case s <- v:
	default:
	}
}

// The relay's read buffers, let go of between a looped stream's events
// (spareBufs) and at a stream's end.
var spareBufsAll = make(Spares[[]byte], 128)

// BufSize is the size of a relay's read buffer.
const BufSize = 8 << 10

// NewBuf returns a kept read buffer, or a new one.
func NewBuf() []byte {
	if b, ok := spareBufsAll.Get(); ok {
		return b
	}
	return make([]byte, BufSize)
}

// PutBuf keeps b for another stream.
func PutBuf(b []byte) {
	if cap(b) >= BufSize {
		spareBufsAll.Put(b[:BufSize])
	}
}
