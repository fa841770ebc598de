package proxy

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"io"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// sideDecoder decompresses a copy of a compressed response for the parser,
// while the compressed bytes themselves are relayed untouched.
//
// Decompressors pull their input from an io.Reader, while the relay pushes
// chunks as they arrive. The decompressor therefore runs on a goroutine of
// its own, and the two proceed in lockstep: feed hands over one chunk and
// returns once the decompressor asks for the next one, that is once it has
// produced everything the chunk allowed. So the parser has seen a chunk's
// events before the chunk is relayed, exactly as for uncompressed bodies,
// and sink is never called concurrently with the relay.
type sideDecoder struct {
	in      chan []byte
	ack     chan struct{}
	done    chan struct{}
	cur     []byte
	started bool
	sink    func([]byte)
	err     error // the decompressor's error, read after done is closed
	limit   int64 // decoded bytes measured at most (0: no limit)
	over    bool  // the limit was reached and decoding stopped
}

// newSideDecoder starts a decoder for a Content-Encoding, or returns nil
// when tokentap cannot decode it. It stops decoding after limit decoded
// bytes (0: no limit): a compression bomb costs at most that much work,
// and the relay, which waits for each chunk to be decoded, never waits
// longer than one chunk's share of it.
func newSideDecoder(encoding []byte, limit int64, sink func([]byte)) *sideDecoder {
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
		// One goroutine: the decoder then decodes synchronously as it is
		// read, instead of reading ahead in the background.
		mk = func(r io.Reader) (io.Reader, error) {
			d, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true))
			if err != nil {
				return nil, err
			}
			return d.IOReadCloser(), nil
		}
	default:
		return nil
	}
	d := &sideDecoder{in: make(chan []byte), ack: make(chan struct{}), done: make(chan struct{}), sink: sink, limit: limit}
	go d.run(mk)
	return d
}

// Read is the decompressor's input: the chunk being fed.
func (d *sideDecoder) Read(p []byte) (int, error) {
	if len(d.cur) == 0 {
		if d.started {
			d.ack <- struct{}{}
		}
		d.started = true
		b, ok := <-d.in
		if !ok {
			return 0, io.EOF
		}
		d.cur = b
	}
	n := copy(p, d.cur)
	d.cur = d.cur[n:]
	return n, nil
}

func (d *sideDecoder) run(mk func(io.Reader) (io.Reader, error)) {
	defer close(d.done)
	r, err := mk(d)
	if err != nil {
		d.err = err
		return
	}
	buf := make([]byte, 16<<10)
	var total int64
	for {
		n, err := r.Read(buf)
		if d.limit > 0 && total+int64(n) > d.limit {
			// Measuring stops here; the relay goes on untouched.
			d.sink(buf[:d.limit-total])
			d.over = true
			return
		}
		total += int64(n)
		if n > 0 {
			d.sink(buf[:n])
		}
		if err != nil {
			if err != io.EOF {
				d.err = err
			}
			return
		}
	}
}

// feed hands one compressed chunk to the decompressor and waits until it
// has decoded all it can. b must not change until feed returns.
func (d *sideDecoder) feed(b []byte) {
	select {
	case d.in <- b:
	case <-d.done:
		return
	}
	select {
	case <-d.ack:
	case <-d.done:
	}
}

// close ends the input and waits for the decompressor; it reports whether
// the compressed stream decoded cleanly to its end.
func (d *sideDecoder) close() bool {
	close(d.in)
	<-d.done
	return d.err == nil
}
