package proxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/tokentap/tokentap/proxy/testkit/chunks"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"golang.org/x/sys/unix"
)

// TestRelayExactBytesUnderSplitsAndStalls: a chunked event stream, cut into
// random writes with random pauses by the backend and read in random small
// pieces with stalls by the client, reaches the client exactly as it left
// the backend, framing included (up to the last chunk, which the proxy
// writes itself), request after request on one kept-alive connection; its
// events are all counted and its length recorded. One large response is
// read only after the proxy's writes have met a full socket buffer.
func TestRelayExactBytesUnderSplitsAndStalls(t *testing.T) {
	wait.Long(t, "randomly split and stalled streams")
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			switch moved := relayExactBytes(t, Options{GoroutineRelay: path.goroutine}); {
			case path.goroutine && moved != 0:
				t.Fatalf("%d streams went to a relay loop with the loops off", moved)
			case !path.goroutine && moved < 5:
				// Short bodies that came whole with the header end before
				// a loop could take them; the others move.
				t.Fatalf("%d of 30 streams went to a relay loop", moved)
			}
		})
	}
}

// relayExactBytes sends 30 chunked responses, cut into random writes with
// pauses, through the proxy to a client reading in random pieces with
// stalls, and compares bytes, framing and records. It returns the streams
// the proxy's relay loops took.
func relayExactBytes(t *testing.T, opts Options) (loopStreams uint64) {
	r := rand.New(rand.NewPCG(7, 8))
	type answer struct {
		body    []byte
		starts  []int
		payload string
		events  int
	}
	answers := make(chan answer, 1)
	up := startRawUpstream(t, func(c net.Conn, _ *http.Request) bool {
		a := <-answers
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		return writePieces(c, a.body, rand.New(rand.NewPCG(uint64(len(a.body)), 9)), 700, 4, 1500)
	})
	tp := startProxyOpts(t, up.url, nil, opts)
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute)) // a framing fault fails, not hangs
	br := bufio.NewReaderSize(c, 16)

	for i := range 30 {
		var payload strings.Builder
		events := 1 + r.IntN(40)
		if i == 7 {
			events = 20000 // about 1.3 MB: more than the sockets hold
		}
		for k := range events {
			payload.WriteString(chatChunk(fmt.Sprintf("tok%d-%d", i, k)))
		}
		body, starts := chunks.Random(r, []byte(payload.String()))
		answers <- answer{body, starts, payload.String(), events}
		if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)); err != nil {
			t.Fatal(err)
		}
		if i == 7 {
			time.Sleep(300 * time.Millisecond) // the proxy's writes block on a full buffer
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("response %d: %v", i, err)
		}
		if len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
			t.Fatalf("response %d: transfer encoding %v", i, resp.TransferEncoding)
		}
		// Read the body through a chunked reader in random pieces with
		// stalls, keeping the raw bytes: http.ReadResponse leaves the
		// body unread in br.
		var raw bytes.Buffer
		cbr := bufio.NewReader(io.TeeReader(br, &raw))
		cr := httputil.NewChunkedReader(cbr)
		var got []byte
		rr := rand.New(rand.NewPCG(uint64(i), 10))
		for {
			piece := make([]byte, 1+rr.IntN(900))
			n, err := cr.Read(piece)
			got = append(got, piece[:n]...)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("response %d: %v after %d body bytes", i, err, len(got))
			}
			if rr.IntN(20) == 0 {
				time.Sleep(time.Duration(rr.IntN(2000)) * time.Microsecond)
			}
		}
		if crlf := make([]byte, 2); func() bool { _, err := io.ReadFull(cbr, crlf); return err != nil }() || string(crlf) != "\r\n" {
			t.Fatalf("response %d: the body does not end with an empty trailer section", i)
		}
		if string(got) != payload.String() {
			t.Fatalf("response %d: the client's body differs from the backend's at byte %d of %d",
				i, firstDiff(got, []byte(payload.String())), payload.Len())
		}
		// The framing: the backend's as it came, from one of its chunk
		// boundaries within the first read on (bytes that came with the
		// header go out with it, in one write), then the end.
		if k := framedFrom(body, starts, raw.Bytes()); k < 0 || k > 8<<10+400 {
			t.Fatalf("response %d: the client's framing is not the backend's (from byte %d)", i, k)
		}
		rec := tp.rec.next(t)
		if rec.Outcome != "ok" || rec.OutputTokens != events || rec.BytesOut != int64(len(payload.String())) {
			t.Fatalf("response %d: record outcome %s, %d tokens (want %d), bytes_out %d (want %d)",
				i, rec.Outcome, rec.OutputTokens, events, rec.BytesOut, len(payload.String()))
		}
	}
	if n := up.conns.Load(); n != 1 {
		t.Fatalf("the backend saw %d connections: the pooled one was not reused", n)
	}
	return tp.p.loops.Streams()
}

// framedFrom returns the first offset k of the backend's body, at a chunk
// boundary before its last chunk (starts: where each chunk begins, the
// last chunk's last), such that the client's raw body ends with the
// backend's framing from k and "0\r\n\r\n"; -1 when there is none.
func framedFrom(body []byte, starts []int, raw []byte) int {
	last := starts[len(starts)-1]
	for _, k := range starts {
		if bytes.HasSuffix(raw, append(bytes.Clone(body[k:last]), "0\r\n\r\n"...)) {
			return k
		}
	}
	return -1
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// Many streams relayed at once share the relay loops: each client gets
// its own backend's bytes, whole and in order, while the backends write
// in random pieces with pauses that interleave the streams' events, and
// each stream gets its record.
func TestRelayLoopManyStreamsAtOnce(t *testing.T) {
	const streams = 60
	payload := func(seed uint64) string {
		r := rand.New(rand.NewPCG(seed, 1))
		var b strings.Builder
		for k := range 20 + r.IntN(200) {
			b.WriteString(chatChunk(fmt.Sprintf("s%d-t%d-%s", seed, k, strings.Repeat("x", r.IntN(50)))))
		}
		return b.String()
	}
	up := startRawUpstream(t, func(c net.Conn, req *http.Request) bool {
		seed, _ := strconv.ParseUint(req.Header.Get("X-Seed"), 10, 64)
		r := rand.New(rand.NewPCG(seed, 2))
		body, _ := chunks.Random(r, []byte(payload(seed)))
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		return writePieces(c, body, r, 400, 3, 800)
	})
	tp := startProxy(t, up.url, nil)
	before := tp.p.loops.Streams()
	errs := make(chan error, streams)
	for i := range streams {
		go func() {
			errs <- func() error {
				c, err := net.Dial("tcp", tp.addr)
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(time.Minute))
				if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`, "X-Seed: "+strconv.Itoa(i))); err != nil {
					return err
				}
				resp, err := http.ReadResponse(bufio.NewReader(c), nil)
				if err != nil {
					return err
				}
				got, err := io.ReadAll(resp.Body)
				if err != nil {
					return fmt.Errorf("stream %d: %w after %d bytes", i, err, len(got))
				}
				if want := payload(uint64(i)); string(got) != want {
					return fmt.Errorf("stream %d: the body differs from its backend's at byte %d of %d", i, firstDiff(got, []byte(want)), len(want))
				}
				return nil
			}()
		}()
	}
	for range streams {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for range streams {
		if rec := tp.rec.next(t); rec.Outcome != "ok" || rec.OutputTokens < 20 {
			t.Fatalf("record %s: outcome %s, %d tokens", rec.RequestID, rec.Outcome, rec.OutputTokens)
		}
	}
	if moved := tp.p.loops.Streams() - before; moved < streams/2 {
		t.Fatalf("%d of %d streams went to a relay loop", moved, streams)
	}
}

// writePieces writes b to c in pieces of 1 to most bytes, pausing up to
// pauseUS µs after one piece in oneIn, all drawn from r; false when a
// write failed.
func writePieces(c net.Conn, b []byte, r *rand.Rand, most, oneIn, pauseUS int) bool {
	for len(b) > 0 {
		n := min(len(b), 1+r.IntN(most))
		if _, err := c.Write(b[:n]); err != nil {
			return false
		}
		b = b[n:]
		if r.IntN(oneIn) == 0 {
			time.Sleep(time.Duration(r.IntN(pauseUS)) * time.Microsecond)
		}
	}
	return true
}

// readStream reads response i from br, whose body must be want.
func readStream(t *testing.T, br *bufio.Reader, i int, want string) *http.Response {
	t.Helper()
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("response %d: %v", i, err)
	}
	got, err := io.ReadAll(resp.Body)
	if err != nil || string(got) != want {
		t.Fatalf("response %d: body %q, %v", i, got, err)
	}
	return resp
}

// expectQuiet checks that nothing more comes on c after the last response
// (a second end of a body would be waiting).
func expectQuiet(t *testing.T, c net.Conn, br *bufio.Reader) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := br.Read(make([]byte, 1)); n != 0 || !sock.IsTimeout(err) {
		t.Fatalf("after the last response: %d more bytes, %v", n, err)
	}
}

// tallyReader counts the bytes read through it.
type tallyReader struct {
	r io.Reader
	n int64
}

func (c *tallyReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// A bare last chunk that comes in one read with the data before it goes
// out with that data: the client gets one clean end (a second would be
// read as the start of the next response, which follows on the same
// connection), and the record's bytes_wire is every byte of the response
// the client received, its end included. A last chunk with trailers is
// not relayed: a bare one ends the body, in the same write, and counts in
// bytes_wire too (tokentap writes the whole response: the server writes no
// end of its own after the record).
func TestBodyEndGoesWithLastData(t *testing.T) {
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			var events strings.Builder
			for k := range 5 {
				events.WriteString(chatChunk(fmt.Sprint("tok", k)))
			}
			body := fmt.Sprintf("%x\r\n%s\r\n", events.Len(), events.String())
			ends := []string{"0\r\n\r\n", "0\r\nX-Checksum: 1\r\n\r\n", "0\r\n\r\n"}
			next := make(chan string, 1)
			up := startRawUpstream(t, func(c net.Conn, _ *http.Request) bool {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
				time.Sleep(20 * time.Millisecond) // the header goes out alone; the stream may move to a loop
				_, err := io.WriteString(c, body+<-next)
				return err == nil
			})
			tp := startProxyOpts(t, up.url, nil, Options{GoroutineRelay: path.goroutine})
			before := tp.p.loops.Streams()
			c, err := net.Dial("tcp", tp.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(30 * time.Second))
			cr := &tallyReader{r: c}
			br := bufio.NewReader(cr)
			for i, end := range ends {
				next <- end
				if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)); err != nil {
					t.Fatal(err)
				}
				resp := readStream(t, br, i, events.String())
				if len(resp.Trailer) != 0 {
					t.Fatalf("response %d: trailers %v reached the client", i, resp.Trailer)
				}
				received := cr.n - int64(br.Buffered())
				cr.n = int64(br.Buffered())
				rec := tp.rec.next(t)
				switch {
				case rec.Outcome != "ok" || rec.OutputTokens != 5:
					t.Fatalf("response %d: outcome %s, %d tokens", i, rec.Outcome, rec.OutputTokens)
				case rec.BytesWire != received:
					t.Fatalf("response %d: bytes_wire %d, the client received %d", i, rec.BytesWire, received)
				}
			}
			expectQuiet(t, c, br)
			if n := up.conns.Load(); n != 1 {
				t.Fatalf("the backend saw %d connections", n)
			}
			if moved := tp.p.loops.Streams() - before; path.goroutine != (moved == 0) {
				t.Fatalf("%d of %d streams went to a relay loop", moved, len(ends))
			}
		})
	}
}

// Pipelined requests: the second request is in the server's read buffer
// when the first response takes the connection over (tokentap writes it
// itself); it is handed back with the connection, and the client reads
// both responses whole, in order, each ended once, on the relay loop and
// on the goroutine path.
func TestPipelinedStreamsEndOnce(t *testing.T) {
	for _, path := range relayPaths {
		t.Run(path.name, func(t *testing.T) {
			up := startRawUpstream(t, func(c net.Conn, r *http.Request) bool {
				io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
				time.Sleep(10 * time.Millisecond)
				ev := chatChunk(r.URL.Path)
				_, err := io.WriteString(c, fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(ev), ev))
				return err == nil
			})
			tp := startProxyOpts(t, up.url, nil, Options{GoroutineRelay: path.goroutine})
			c, err := net.Dial("tcp", tp.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)+
				postJSON("/v1/completions", `{"stream":true}`)); err != nil {
				t.Fatal(err)
			}
			br := bufio.NewReader(c)
			for i, want := range []string{"/v1/chat/completions", "/v1/completions"} {
				readStream(t, br, i, chatChunk(want))
			}
			expectQuiet(t, c, br)
			for range 2 {
				if rec := tp.rec.next(t); rec.Outcome != "ok" {
					t.Fatalf("record %s: outcome %s (%s)", rec.Path, rec.Outcome, rec.Error)
				}
			}
		})
	}
}

// dataSegsIn is how many segments carrying data c's socket has received.
func dataSegsIn(t *testing.T, c net.Conn) uint32 {
	t.Helper()
	raw, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var info *unix.TCPInfo
	var gerr error
	if err := raw.Control(func(fd uintptr) { info, gerr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || gerr != nil {
		t.Fatal(err, gerr)
	}
	return info.Data_segs_in
}

// A streamed response that came whole in one upstream read, header, body
// and last chunk, reaches the client in one write: one data segment on
// loopback (it took three: the header with the first chunk, the rest,
// the server's last chunk), two on a kept-alive connection, whose first
// write carries the first token and goes out split so that the client
// acknowledges it as it comes (measure.ClientSide.SplitFirst). One with
// trailers ends with a bare last chunk in the same write: the next
// response on the kept-alive connection reads clean.
func TestWholeResponseInOneWrite(t *testing.T) {
	var events strings.Builder
	for k := range 3 {
		events.WriteString(chatChunk(fmt.Sprint("tok", k)))
	}
	one := fmt.Sprintf("%x\r\n%s\r\n", len(chatChunk("tok0")), chatChunk("tok0"))
	rest := fmt.Sprintf("%x\r\n%s\r\n", events.Len()-len(chatChunk("tok0")), events.String()[len(chatChunk("tok0")):])
	ends := []string{"0\r\n\r\n", "0\r\nX-Checksum: 1\r\n\r\n", "0\r\n\r\n"}
	next := make(chan string, 1)
	up := startRawUpstream(t, func(c net.Conn, _ *http.Request) bool {
		_, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"+one+rest+<-next)
		return err == nil
	})
	tp := startProxy(t, up.url, nil)
	c, err := net.Dial("tcp", tp.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(c)
	for i, end := range ends {
		next <- end
		before := dataSegsIn(t, c)
		if _, err := io.WriteString(c, postJSON("/v1/chat/completions", `{"stream":true}`)); err != nil {
			t.Fatal(err)
		}
		readStream(t, br, i, events.String())
		rec := tp.rec.next(t) // the record is made after the response's last write
		segs := dataSegsIn(t, c) - before
		switch {
		case rec.Outcome != "ok" || rec.OutputTokens != 3:
			t.Fatalf("response %d: outcome %s, %d tokens", i, rec.Outcome, rec.OutputTokens)
		case int(segs) != min(i+1, 2):
			t.Fatalf("response %d: came in %d segments, want %d", i, segs, min(i+1, 2))
		}
	}
	expectQuiet(t, c, br)
}
