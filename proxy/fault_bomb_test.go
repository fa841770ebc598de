package proxy

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"io"
	"net/http"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// zstdBomb is a zstd frame that declares a window of window bytes and
// decodes to blocks×128 KiB: an event (a raw block), then RLE blocks of
// zeros, four bytes each (RFC 8878 §3.1.1: a 1 GiB body in 32 KB).
func zstdBomb(window uint, blocks int, event string) []byte {
	var b bytes.Buffer
	b.Write([]byte{0x28, 0xb5, 0x2f, 0xfd}) // magic
	b.WriteByte(0)                          // no content size, not single segment, no checksum, no dictionary
	exp := 0
	for 1<<(10+exp) < window {
		exp++
	}
	b.WriteByte(byte(exp << 3)) // Window_Descriptor: 2^(10+exp)
	header := func(last bool, typ, size int) {
		v := uint32(typ<<1 | size<<3)
		if last {
			v |= 1
		}
		var h [4]byte
		binary.LittleEndian.PutUint32(h[:], v)
		b.Write(h[:3])
	}
	header(false, 0, len(event)) // a raw block
	b.WriteString(event)
	for i := 0; i < blocks; i++ {
		header(i == blocks-1, 1, 128<<10) // an RLE block: 128 KiB of one byte
		b.WriteByte(0)
	}
	return b.Bytes()
}

// brotliBomb is a brotli stream with the format's largest window (16 MiB)
// that decodes to an event and then n bytes of zeros.
func brotliBomb(n int, event string) []byte {
	var b bytes.Buffer
	w := brotli.NewWriterOptions(&b, brotli.WriterOptions{Quality: 1, LGWin: 24})
	io.WriteString(w, event)
	zeros := make([]byte, 1<<20)
	for i := 0; i < n>>20; i++ {
		w.Write(zeros)
	}
	w.Close()
	return b.Bytes()
}

// TestFaultDecoderMemoryBounded: compression bombs in flight at once cost
// the process no more than their decoders' stated bounds (a zstd frame that
// declares a 128 MiB window is refused; brotli holds at most its 16 MiB
// window; decoded bytes wait for the relay past 1 MiB). Their bytes reach
// the client untouched and their records are partial. Before the bounds,
// one zstd bomb took the heap from 22 MB to 561 MB.
func TestFaultDecoderMemoryBounded(t *testing.T) {
	wait.Long(t, "compression bombs")
	event := chatChunk("first")
	zb := zstdBomb(128<<20, 8192, event) // 1 GiB decoded, a window past the content coding's 8 MiB
	zok := zstdBomb(8<<20, 4096, event)  // 512 MiB decoded in an 8 MiB window: decoded up to the limit
	// 80 MiB each: past what the proxy decodes (max_decoded_bytes, 64
	// MiB by default), by when each decoder has long filled its window,
	// which is what its bound speaks of. Made and decoded under the race
	// detector, 256 MiB each took the test 52 s.
	bb := brotliBomb(80<<20, event)
	var gb bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&gb, gzip.BestCompression)
	io.WriteString(zw, event)
	for i := 0; i < 80; i++ {
		zw.Write(make([]byte, 1<<20))
	}
	zw.Close()
	bombs := []struct {
		enc   string
		body  []byte
		bound int64 // what one in flight may hold, as the decoder's doc states it
	}{
		{"zstd", zb, 2 << 20}, {"zstd", zb, 2 << 20}, {"zstd", zb, 2 << 20}, {"zstd", zb, 2 << 20},
		{"zstd", zok, 10 << 20}, {"zstd", zok, 10 << 20},
		{"br", bb, 18 << 20}, {"br", bb, 18 << 20},
		{"gzip", gb.Bytes(), 2 << 20}, {"gzip", gb.Bytes(), 2 << 20},
	}
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		i := 0
		for ; i < len(bombs) && bombs[i].enc+itoa(i) != r.URL.Query().Get("b"); i++ {
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", bombs[i].enc)
		w.Write(bombs[i].body)
	})
	tp := startProxy(t, up.URL, nil) // max_decoded_bytes: the default, 64 MiB
	// The peak of the heap in use counts garbage too: at GOGC=100, on a
	// machine busy enough to slow the collector, the decoders' freed
	// buffers alone lifted it past the bound (169 MiB against 168, one
	// run beside a second copy of the suite). A tighter pace keeps the
	// peak near what is live, which is what the bounds speak of.
	defer debug.SetGCPercent(debug.SetGCPercent(25))
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := int64(ms.HeapInuse)
	var peak atomic.Int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			var m runtime.MemStats
			runtime.ReadMemStats(&m)
			if v := int64(m.HeapInuse); v > peak.Load() {
				peak.Store(v)
			}
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
		}
	}()
	tr := &http.Transport{DisableCompression: true}
	var wg sync.WaitGroup
	var bound int64
	for i, b := range bombs {
		bound += b.bound
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions?b="+b.enc+itoa(i), `{"stream":true}`))
			if err != nil {
				t.Error(err)
				return
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if !bytes.Equal(got, b.body) {
				t.Errorf("%s bomb: %d bytes reached the client, %d sent", b.enc, len(got), len(b.body))
			}
		}()
	}
	wg.Wait()
	for range bombs {
		// The zstd frame is refused at its header: its event is not
		// measured; the others measure theirs before their limit.
		rec := tp.rec.next(t)
		events := 1
		if rec.Error == "" && rec.BytesOut == int64(len(zb)) {
			events = 0
		}
		if !rec.Partial || rec.Outcome != "ok" || rec.Events != events {
			t.Errorf("record: partial %v outcome %s events %d (want %d), %d bytes", rec.Partial, rec.Outcome, rec.Events, events, rec.BytesOut)
		}
	}
	close(stop)
	<-sampled
	// Twice the bounds: the collector still lets the heap grow past what
	// is live before it runs, and the test's own client and server hold
	// the bombs' bytes.
	grown := peak.Load() - base
	t.Logf("%d bombs in flight: heap in use grew by %d MiB (bounds %d MiB)", len(bombs), grown>>20, bound>>20)
	if grown > 2*bound+32<<20 {
		t.Errorf("%d bombs in flight grew the heap by %d MiB, their bounds add up to %d MiB", len(bombs), grown>>20, bound>>20)
	}
}
