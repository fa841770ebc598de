package proxy

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// flushWriter is a compressing writer that can flush a block.
type flushWriter interface {
	io.WriteCloser
	Flush() error
}

// streamEncoders make a compressing writer for each Content-Encoding
// tokentap decodes.
var streamEncoders = map[string]func(io.Writer) flushWriter{
	"gzip":    func(w io.Writer) flushWriter { return gzip.NewWriter(w) },
	"deflate": func(w io.Writer) flushWriter { return zlib.NewWriter(w) },
	"br":      func(w io.Writer) flushWriter { return brotli.NewWriter(w) },
	"zstd": func(w io.Writer) flushWriter {
		z, _ := zstd.NewWriter(w)
		return z
	},
	// One encoder goroutine, as servers that flush per event often run it.
	"zstd-sync": func(w io.Writer) flushWriter {
		z, _ := zstd.NewWriter(w, zstd.WithEncoderConcurrency(1))
		return z
	},
}

// codingOf is the Content-Encoding of a streamEncoders entry.
func codingOf(enc string) string { return strings.TrimSuffix(enc, "-sync") }

// Compressed streams reach the client as their bytes arrive: the relay
// never waits for the side decoder, and each event is measured when its
// own compressed bytes were delivered. One flushed block per event, in
// lockstep: the upstream sends event k+1 only once the client holds event
// k, so an event held back until the next one arrives stalls the stream
// and fails the test, whatever the machine's load (no bound on wall time).
func TestFaultCompressedStreamsOnTime(t *testing.T) {
	const events = 6
	for enc, newWriter := range streamEncoders {
		t.Run(enc, func(t *testing.T) {
			// The compressed bytes of each event, made before the request so
			// the client knows where each event ends.
			whole, chunks, ends, tail := compressedEvents(newWriter, events)
			held := make(chan int, events) // the client holds event k
			stalled := make(chan int, 1)
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.Header().Set("Content-Encoding", codingOf(enc))
				for k := 0; k < events; k++ {
					w.Write(chunks[k])
					flush(w)
					select {
					case <-held:
					case <-time.After(10 * time.Second):
						stalled <- k
						return
					}
				}
				w.Write(tail)
			})
			tp := startProxy(t, up.URL, nil)
			tr := &http.Transport{DisableCompression: true}
			start := time.Now()
			resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
			if err != nil {
				t.Fatal(err)
			}
			var got []byte
			var firstAt, secondAt time.Time
			buf := make([]byte, 64<<10)
			for k := 0; ; {
				n, err := resp.Body.Read(buf)
				now := time.Now()
				got = append(got, buf[:n]...)
				for k < len(ends) && len(got) >= ends[k] {
					switch k {
					case 0:
						firstAt = now
					case 1:
						secondAt = now
					}
					held <- k
					k++
				}
				if err != nil {
					break
				}
			}
			resp.Body.Close()
			select {
			case k := <-stalled:
				t.Fatalf("event %d was held back until the next one came", k)
			default:
			}
			if !bytes.Equal(got, whole.Bytes()) {
				t.Fatalf("compressed body changed: %d bytes vs %d", len(got), whole.Len())
			}
			rec := tp.rec.next(t)
			if rec.Events != events || rec.Partial || rec.ITLCount != events-1 {
				t.Fatalf("record: events %d partial %v itl count %d", rec.Events, rec.Partial, rec.ITLCount)
			}
			// tokentap's clock starts after the client's and stops when its
			// write returned, before the client read: its TTFT is no longer
			// than the client's. An event the decompressor gave out only
			// once it had read the next chunk would be stamped with that
			// chunk's times: as late as the next event (secondAt).
			if clientTTFT := firstAt.Sub(start); rec.TTFT <= 0 || rec.TTFT > clientTTFT {
				t.Errorf("ttft %v, the client's %v (next event at %v)", rec.TTFT, clientTTFT, secondAt.Sub(start))
			}
		})
	}
}

// compressedEvents compresses events chat chunks, one flushed block each:
// the whole stream, each event's compressed bytes, where each ends in the
// stream, and the bytes that close it.
func compressedEvents(newWriter func(io.Writer) flushWriter, events int) (whole *bytes.Buffer, chunks [][]byte, ends []int, tail []byte) {
	whole = &bytes.Buffer{}
	zw := newWriter(whole)
	for range events {
		io.WriteString(zw, chatChunk("tok"))
		zw.Flush()
		chunks = append(chunks, bytes.Clone(whole.Bytes()[sum(ends):]))
		ends = append(ends, whole.Len())
	}
	zw.Close()
	return whole, chunks, ends, bytes.Clone(whole.Bytes()[ends[events-1]:])
}

func sum(ends []int) int {
	if len(ends) == 0 {
		return 0
	}
	return ends[len(ends)-1]
}

// A compression bomb passes through untouched, but tokentap decodes only
// MaxDecodedBytes of it for measuring, and marks the record partial.
func TestFaultGzipBomb(t *testing.T) {
	// 256 gzip members of 1 MiB of zeros each (a reader decodes them as one
	// stream), the first with an event in front.
	member := func(prefix string) []byte {
		var b bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
		io.WriteString(zw, prefix)
		zw.Write(make([]byte, 1<<20))
		zw.Close()
		return b.Bytes()
	}
	var bomb bytes.Buffer
	bomb.Write(member(chatChunk("first")))
	zeros := member("")
	for i := 1; i < 256; i++ {
		bomb.Write(zeros)
	}
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "gzip")
		w.Write(bomb.Bytes())
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.MaxDecodedBytes = 4 << 20 })
	tr := &http.Transport{DisableCompression: true}
	start := time.Now()
	resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.Equal(got, bomb.Bytes()) {
		t.Fatalf("the bomb's bytes changed: %d vs %d", len(got), bomb.Len())
	}
	rec := tp.rec.next(t)
	if !rec.Partial || rec.Events != 1 || rec.Outcome != "ok" {
		t.Fatalf("record: partial %v events %d outcome %s", rec.Partial, rec.Events, rec.Outcome)
	}
	t.Logf("%d compressed bytes (256 MiB decoded) relayed in %v", bomb.Len(), time.Since(start))
}

// TestCompressedChunksInOneRead: many compressed chunks that arrive in one
// read of the upstream socket are all measured: the side decoder can hand
// back a chunk's events before the read's write went out, and they are
// delivered with that write (they were dropped, one now and then, before).
func TestCompressedChunksInOneRead(t *testing.T) {
	const events = 40
	for enc, newWriter := range streamEncoders {
		t.Run(enc, func(t *testing.T) {
			var body bytes.Buffer
			var cw bytes.Buffer
			zw := newWriter(&cw)
			for range events {
				io.WriteString(zw, chatChunk("z"))
				zw.Flush()
				fmt.Fprintf(&body, "%x\r\n%s\r\n", cw.Len(), cw.Bytes())
				cw.Reset()
			}
			zw.Close()
			if cw.Len() > 0 {
				fmt.Fprintf(&body, "%x\r\n%s\r\n", cw.Len(), cw.Bytes())
			}
			body.WriteString("0\r\n\r\n")
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				buf := make([]byte, 4096)
				c.Read(buf) // the request
				// Header and every chunk in one write: one read upstream.
				c.Write(append([]byte("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: "+codingOf(enc)+
					"\r\nTransfer-Encoding: chunked\r\n\r\n"), body.Bytes()...))
				time.Sleep(100 * time.Millisecond)
			}()
			tp := startProxy(t, "http://"+ln.Addr().String(), nil)
			tr := &http.Transport{DisableCompression: true}
			resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			rec := tp.rec.next(t)
			if rec.Events != events || rec.ITLCount != events-1 || rec.TTFT < 0 {
				t.Fatalf("events %d, gaps %d, ttft %v: want %d events, %d gaps", rec.Events, rec.ITLCount, rec.TTFT, events, events-1)
			}
		})
	}
}
