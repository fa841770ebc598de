package proxy

import "bufio"

// spares keeps up to its capacity of values for reuse by any goroutine;
// more are left to the collector. Unlike a sync.Pool, which keeps every
// value put until two collections have passed, it does not hold what a
// crowd of open streams let go of: their memory is free again at once,
// and a burst of new streams reuses the values of those that came before.
type spares[T any] chan T

// get returns a kept value, if one is.
func (s spares[T]) get() (v T, ok bool) {
	select {
	case v = <-s:
		return v, true
	default:
		return v, false
	}
}

// put keeps v, unless the store is full.
func (s spares[T]) put(v T) {
	select {
	case s <- v:
	default:
	}
}

// The buffers streams hold only while bytes move: upstream connections'
// readers, let go of while a relay loop reads the socket (upConn.parkReader),
// and the relay's read buffers, let go of between a looped stream's events
// (spareBufs).
var (
	spareReaders   = make(spares[*bufio.Reader], 128)
	spareRelayBufs = make(spares[[]byte], 128)
)

// relayBufSize is the size of a relay's read buffer.
const relayBufSize = 8 << 10

// newRelayBuf returns a kept read buffer, or a new one.
func newRelayBuf() []byte {
	if b, ok := spareRelayBufs.get(); ok {
		return b
	}
	return make([]byte, relayBufSize)
}

// spareRelayBuf keeps b for another stream.
func spareRelayBuf(b []byte) {
	if cap(b) >= relayBufSize {
		spareRelayBufs.put(b[:relayBufSize])
	}
}

// newUpReader returns a kept reader of c, or a new one.
func newUpReader(c *upConn) *bufio.Reader {
	if br, ok := spareReaders.get(); ok {
		br.Reset(c)
		return br
	}
	return bufio.NewReaderSize(c, upReadBuffer)
}
