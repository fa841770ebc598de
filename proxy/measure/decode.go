package measure

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// sideDecoder decompresses a copy of a compressed response for the parser,
// while the compressed bytes themselves are relayed untouched.
//
// The relay never waits for it: feed queues a copy of each chunk and
// returns at once, and a goroutine of its own decompresses the queue. What
// it decodes is kept with the number of the chunk whose bytes produced it,
// and the relay takes it (take) before it feeds the next chunk and once
// more at the end; by then that chunk's read and delivery times are known,
// so every event is stamped with the times of the chunk it came in, however
// late it was decoded. A decompressor that falls behind by more than
// maxDecodeQueue chunks, or past the byte limit, stops measuring (the
// record is partial); the relay goes on untouched.
//
// Memory: what a response can make one decoder hold is bounded whatever
// its bytes announce: the decompressor's window (zstd frames declaring more
// than maxZstdWindow are refused; brotli's is at most 16 MiB by its format,
// deflate's 32 KiB), decoded bytes not yet taken (the decompressor waits
// once maxPendingDecoded are, until the relay takes them), and the queued
// compressed copies (maxDecodeQueue chunks of one upstream read each).
type sideDecoder struct {
	in    chan []byte
	done  chan struct{}
	limit int64 // decoded bytes measured at most (0: no limit)

	// The decompressor's goroutine only, until done is closed.
	cur  []byte
	seq  int // the chunk being consumed
	err  error
	over bool // the byte limit was reached and decoding stopped

	stopped atomic.Bool // the decompressor ended: feeding is pointless

	mu      sync.Mutex
	decoded []decodedPart
	pending int // bytes in decoded

	// full: the decompressor waits for a take (close takes then); room:
	// a take happened. One token each: the waiter checks again.
	full, room chan struct{}

	// The relay's.
	dropped bool // a chunk could not be queued: decoding stopped
	closed  bool
}

// decodedPart is decoded bytes and the chunk they came from.
type decodedPart struct {
	seq int
	b   []byte
}

// maxDecodeQueue bounds the chunks waiting for the decompressor.
const maxDecodeQueue = 256

// maxPendingDecoded bounds the decoded bytes not yet taken: past it the
// decompressor waits for the relay (a bomb decodes no faster than it is
// measured).
const maxPendingDecoded = 1 << 20

// maxZstdWindow is the largest zstd window decoded: RFC 9659 §3 bounds
// the "zstd" content coding to 8 MiB (encoders must not use more); a frame
// that declares more is refused and the record is partial.
const maxZstdWindow = 8 << 20

// newSideDecoder starts a decoder for a Content-Encoding, or returns nil
// when tokentap cannot decode it. It stops decoding after limit decoded
// bytes (0: no limit): a compression bomb costs at most that much work.
func newSideDecoder(encoding []byte, limit int64) *sideDecoder {
	var mk func(io.Reader) (io.Reader, error)
	switch string(bytes.ToLower(bytes.TrimSpace(encoding))) {
	case "gzip", "x-gzip":
		mk = func(r io.Reader) (io.Reader, error) { return gzip.NewReader(r) }
	case "deflate":
		// HTTP's "deflate" is zlib-wrapped (RFC 9110 §8.4.1.2).
		mk = func(r io.Reader) (io.Reader, error) { return zlib.NewReader(r) }
	case "br":
		mk = func(r io.Reader) (io.Reader, error) { return brotli.NewReader(r), nil }
	case "zstd":
		mk = newZstdReader
	default:
		return nil
	}
	d := &sideDecoder{in: make(chan []byte, maxDecodeQueue), done: make(chan struct{}), limit: limit, seq: -1,
		full: make(chan struct{}, 1), room: make(chan struct{}, 1)}
	go d.run(mk)
	return d
}

// Read is the decompressor's input: the queued chunks, in order.
func (d *sideDecoder) Read(p []byte) (int, error) {
	if len(d.cur) == 0 {
		b, ok := <-d.in
		if !ok {
			return 0, io.EOF
		}
		d.cur = b
		d.seq++
	}
	n := copy(p, d.cur)
	d.cur = d.cur[n:]
	return n, nil
}

func (d *sideDecoder) run(mk func(io.Reader) (io.Reader, error)) {
	defer close(d.done)
	defer func() {
		// Decoding ended early or at the end: what is still queued, or
		// queued until the relay closes in, is let go at once.
		d.stopped.Store(true)
		for range d.in {
		}
	}()
	r, err := mk(d)
	if err != nil {
		d.err = err
		return
	}
	if z, ok := r.(*pooledZstd); ok {
		defer z.release()
	}
	var total int64
	for {
		// A buffer of its own per read, kept as it is: no copy, and no
		// part that grows by doubling.
		buf := make([]byte, 16<<10)
		n, err := r.Read(buf)
		if d.limit > 0 && total+int64(n) > d.limit {
			// Measuring stops here; the relay goes on untouched.
			d.keep(buf[:d.limit-total])
			d.over = true
			return
		}
		total += int64(n)
		if n > 0 {
			d.keep(buf[:n])
		}
		if err != nil {
			if err != io.EOF {
				d.err = err
			}
			return
		}
	}
}

// keep stores decoded bytes, which it owns from then on, under the chunk
// being consumed: they cannot come from a later one. Past
// maxPendingDecoded untaken bytes it waits for a take.
func (d *sideDecoder) keep(b []byte) {
	d.mu.Lock()
	d.decoded = append(d.decoded, decodedPart{seq: d.seq, b: b})
	d.pending += len(b)
	full := d.pending >= maxPendingDecoded
	d.mu.Unlock()
	for full {
		select {
		case d.full <- struct{}{}:
		default:
		}
		<-d.room
		d.mu.Lock()
		full = d.pending >= maxPendingDecoded
		d.mu.Unlock()
	}
}

// feed queues a copy of the next compressed chunk. It never blocks.
func (d *sideDecoder) feed(b []byte) {
	if d.closed || d.stopped.Load() {
		return
	}
	select {
	case d.in <- append([]byte(nil), b...):
	default:
		// Too far behind: stop measuring rather than hold the relay.
		d.dropped = true
		d.closed = true
		close(d.in)
	}
}

// take returns what was decoded since the last take, in order.
func (d *sideDecoder) take() []decodedPart {
	d.mu.Lock()
	parts := d.decoded
	d.decoded, d.pending = nil, 0
	d.mu.Unlock()
	select {
	case d.room <- struct{}{}:
	default:
	}
	return parts
}

// close ends the input and waits for the decompressor to decode what is
// queued, calling consume whenever it waits for decoded bytes to be taken
// and once at the end (consume calls take); it reports whether what it
// decoded decoded cleanly (over and dropped say whether it stopped early).
func (d *sideDecoder) close(consume func()) bool {
	if !d.closed {
		d.closed = true
		close(d.in)
	}
	for {
		select {
		case <-d.full:
			consume()
		case <-d.done:
			consume()
			return d.err == nil
		}
	}
}

// chunkTimes are when a compressed chunk was read and delivered, and how
// long writes had waited for the client by its delivery.
type chunkTimes struct {
	read, flush time.Time
	stall       time.Duration
	sent        int64 // the client connection's bytes written by its delivery
}

// zstdDecoders keeps zstd decoders between responses. A decoder holds a
// window of the size its frame declares (8 MiB for most encoders'
// defaults), made and zeroed when it meets the frame: 8.4 MiB and 1.5 ms
// of CPU per compressed stream, on the relay's cores and the collector's,
// where a decoder kept from an earlier stream reuses its window.
var zstdDecoders sync.Pool

// pooledZstd is a zstd decoder taken from zstdDecoders for one response.
type pooledZstd struct{ *zstd.Decoder }

// newZstdReader decodes r with a kept decoder, or a new one. One goroutine:
// the decoder then decodes synchronously as it is read, instead of reading
// ahead in the background; its window is bounded (maxZstdWindow).
func newZstdReader(r io.Reader) (io.Reader, error) {
	if d, ok := zstdDecoders.Get().(*zstd.Decoder); ok {
		if err := d.Reset(r); err != nil {
			d.Close()
			return nil, err
		}
		return &pooledZstd{d}, nil
	}
	d, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
		zstd.WithDecoderMaxWindow(maxZstdWindow), zstd.WithDecoderMaxMemory(maxZstdWindow))
	if err != nil {
		return nil, err
	}
	return &pooledZstd{d}, nil
}

// release lets go of the response's bytes and keeps the decoder.
func (z *pooledZstd) release() {
	if z.Reset(nil) != nil {
		z.Close()
		return
	}
	zstdDecoders.Put(z.Decoder)
}
