package relay

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http/httputil"
	"strings"
	"testing"

	"github.com/tokentap/tokentap/proxy/testkit/chunks"
)

// scanAll runs the scanner over body cut at random points, and returns the
// data it found and how many bytes it consumed.
func scanAll(r *rand.Rand, body []byte) (data []byte, used int, err error) {
	var s chunkScanner
	for used < len(body) && !s.done() {
		end := min(len(body), used+1+r.IntN(40))
		p := body[used:end]
		for len(p) > 0 && !s.done() {
			d, n, err := s.next(p)
			data = append(data, d...)
			used += n
			p = p[n:]
			if err != nil {
				return data, used, err
			}
		}
	}
	return data, used, nil
}

func TestChunkScannerAnySplit(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for i := range 500 {
		payload := make([]byte, r.IntN(3000))
		for j := range payload {
			payload[j] = byte(r.IntN(256)) // CR, LF and hex digits among them
		}
		body, _ := chunks.Random(r, payload)
		stray := []byte("HTTP/1.1 200 OK\r\n")
		data, used, err := scanAll(r, append(bytes.Clone(body), stray...))
		if err != nil || !bytes.Equal(data, payload) || used != len(body) {
			t.Fatalf("case %d: err %v, %d of %d data bytes equal, consumed %d of a %d-byte body",
				i, err, len(data), len(payload), used, len(body))
		}
	}
}

func TestChunkScannerRejects(t *testing.T) {
	for _, body := range []string{
		"\r\n",                     // no size
		"x\r\n",                    // not hex
		"5\nhello\r\n0\r\n\r\n",    // bare LF after the size
		"5\r\nhelloX\r\n0\r\n\r\n", // data longer than its size
		"5\r\nhello\n0\r\n\r\n",    // bare LF after the data
		"5 x\r\nhello\r\n",         // junk after the size
		"5;a\nb\r\nhello\r\n",      // LF inside an extension
		"1000000000000000\r\n",     // 16 hex digits
		"0\r\nX: 1\n\r\n",          // bare LF in the trailers
		"5;" + strings.Repeat("e", maxChunkLine) + "\r\n",
		"0\r\n" + strings.Repeat("X: 1\r\n", maxTrailer/6+1) + "\r\n",
	} {
		_, _, err := scanAll(rand.New(rand.NewPCG(3, 4)), []byte(body))
		if !errors.Is(err, errBadChunk) {
			t.Errorf("%.40q: err %v, want errBadChunk", body, err)
		}
	}
}

// FuzzChunkScanner: whatever the bytes and however they are cut, a body the
// scanner accepts decodes to the same data with net/http's chunked reader
// (which is laxer: it also takes bare LF line ends).
func FuzzChunkScanner(f *testing.F) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 8 {
		body, _ := chunks.Random(r, []byte("data: {\"a\":1}\n\n"))
		f.Add(body, uint64(r.Uint32()))
	}
	f.Add([]byte("5\r\nhello\r\n0\r\n\r\n"), uint64(1))
	f.Fuzz(func(t *testing.T, body []byte, seed uint64) {
		data, used, err := scanAll(rand.New(rand.NewPCG(seed, seed)), body)
		if err != nil || used == 0 {
			return
		}
		var s chunkScanner
		for p := body[:used]; len(p) > 0; {
			_, n, _ := s.next(p)
			p = p[n:]
		}
		if !s.done() {
			return // the body was cut short: nothing to compare
		}
		want, rerr := io.ReadAll(httputil.NewChunkedReader(bytes.NewReader(body[:used])))
		if rerr != nil || !bytes.Equal(data, want) {
			t.Fatalf("accepted %q as %q; net/http reads %q, %v", body[:used], data, want, rerr)
		}
	})
}

// BenchmarkChunkScanner follows the framing of 64 events of a stream,
// size lines, data and the last chunk, without the sockets.
func BenchmarkChunkScanner(b *testing.B) {
	event := `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}` + "\n\n"
	var body []byte
	frame := []byte(fmt.Sprintf("%x\r\n%s\r\n", len(event), event))
	for range 64 {
		body = append(body, frame...)
	}
	body = append(body, "0\r\n\r\n"...)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		var s chunkScanner
		for off := 0; off < len(body) && !s.done(); {
			_, k, err := s.next(body[off:])
			if err != nil {
				b.Fatal(err)
			}
			off += k
		}
	}
}
