package proxy

import (
	"bytes"
	"io"
	"maps"
	"math"
	"net/http"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// TestCompressedTTFTMatchesClientClock compares each compressed stream's
// ttft_ms with the client's own clock. The upstream sends one flushed
// block per event, the first after 20 ms, the second 100 ms later and the
// rest 10 ms apart; the client knows where each event's compressed bytes end and notes when it
// holds them. tokentap's clock starts after the client's and its first
// token is stamped when its write returned, so
//
//	client TTFT − ttft_ms = the request's way in + the first token's way out,
//
// a few tenths of a millisecond on loopback. A stamp taken one chunk late
// (a decoder that handed out an event only after reading the next chunk)
// adds the 100 ms before the second. Every record's first token must be
// stamped before the upstream sent the second event (only a stall of 100
// ms between a write and its stamp could break that on a busy machine);
// with TOKENTAP_TIMING_STRICT=1 on an idle machine each record's
// |client TTFT − ttft_ms| must be under 2 ms. A plain stream (identity)
// is timed the same way beside them: on a busy machine the client's own
// clock, in this process, is late now and then for all of them alike.
func TestCompressedTTFTMatchesClientClock(t *testing.T) {
	wait.Long(t, "streams in five encodings over loopback")
	const events, requests = 4, 10
	strict := os.Getenv("TOKENTAP_TIMING_STRICT") != ""
	encoders := map[string]func(io.Writer) flushWriter{"identity": func(w io.Writer) flushWriter { return plainWriter{w} }}
	maps.Copy(encoders, streamEncoders)
	// identity: a plain stream, timed the same way beside the others.
	for _, enc := range []string{"identity", "gzip", "deflate", "br", "zstd"} {
		t.Run(enc, func(t *testing.T) {
			whole, chunks, ends, tail := compressedEvents(encoders[enc], events)
			sentSecond := make(chan time.Time, 1)
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.Header().Set("Content-Encoding", enc)
				w.WriteHeader(200)
				flush(w)
				time.Sleep(20 * time.Millisecond)
				for k := 0; k < events; k++ {
					switch k {
					case 0:
					case 1:
						time.Sleep(100 * time.Millisecond)
					default:
						time.Sleep(10 * time.Millisecond)
					}
					if k == 1 {
						sentSecond <- time.Now()
					}
					w.Write(chunks[k])
					flush(w)
				}
				w.Write(tail)
			})
			tp := startProxy(t, up.URL, nil)
			tr := &http.Transport{DisableCompression: true}
			defer tr.CloseIdleConnections()
			var diffs []float64
			for i := 0; i < requests; i++ {
				start := time.Now()
				resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
				if err != nil {
					t.Fatal(err)
				}
				var got []byte
				var firstAt time.Time
				buf := make([]byte, 64<<10)
				for {
					n, err := resp.Body.Read(buf)
					now := time.Now()
					got = append(got, buf[:n]...)
					if firstAt.IsZero() && len(got) >= ends[0] {
						firstAt = now
					}
					if err != nil {
						break
					}
				}
				resp.Body.Close()
				second := <-sentSecond
				if !bytes.Equal(got, whole.Bytes()) {
					t.Fatalf("compressed body changed: %d bytes vs %d", len(got), whole.Len())
				}
				rec := tp.rec.next(t)
				if rec.Events != events || rec.Partial {
					t.Fatalf("record: events %d partial %v", rec.Events, rec.Partial)
				}
				client := firstAt.Sub(start)
				// The record's first token was stamped after tokentap's
				// arrival (after start) and before the upstream sent the
				// second event, 100 ms after the first.
				if rec.TTFT <= 0 || rec.TTFT >= second.Sub(start) {
					t.Errorf("request %d: ttft %v, not before the second event was sent (%v); the client's %v", i, rec.TTFT, second.Sub(start), client)
				}
				diffs = append(diffs, math.Abs(ms(client)-ms(rec.TTFT)))
				if os.Getenv("TOKENTAP_TIMING_DEBUG") != "" {
					t.Logf("%s %d: client %v ttft %v e2e %v", enc, i, client, rec.TTFT, rec.E2E)
				}
			}
			slices.Sort(diffs)
			t.Logf("%s: |client TTFT − ttft_ms| p50 %.2f ms, max %.2f ms over %d requests", enc, diffs[len(diffs)/2], diffs[len(diffs)-1], len(diffs))
			if strict && diffs[len(diffs)-1] >= 2 {
				t.Errorf("%s: |client TTFT − ttft_ms| up to %.2f ms, not under 2 ms", enc, diffs[len(diffs)-1])
			}
		})
	}
}

// plainWriter is a stream without compression, for a plain stream timed
// beside the compressed ones.
type plainWriter struct{ io.Writer }

func (plainWriter) Flush() error { return nil }
func (plainWriter) Close() error { return nil }
