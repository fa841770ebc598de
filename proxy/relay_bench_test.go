package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/downstream"
	"github.com/tokentap/tokentap/sse/dialect"
	"go.uber.org/zap/zapcore"
)

// repeatReader returns the same chunk on every Read, like an upstream that
// sends one event per read forever.
type repeatReader struct{ chunk []byte }

func (r *repeatReader) Read(p []byte) (int, error) { return copy(p, r.chunk), nil }

var benchEvent = []byte(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}` + "\n\n")

// newProxyForBench returns a proxy with one route that is never dialled.
func newProxyForBench(tb testing.TB, sinks ...metrics.Sink) *Proxy {
	tb.Helper()
	p, err := New(Config{Routes: []Route{{Name: "r", Prefix: "/", Upstream: "http://127.0.0.1:1", Timeouts: DefaultTimeouts}}},
		Options{Sinks: sinks})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// streamingExchange builds an exchange in the state ServeHTTP leaves it in
// for an OpenAI stream, reading from body.
func streamingExchange(p *Proxy, body io.Reader) *exchange {
	x := acquireExchange(p, p.snap.Load(), time.Now())
	p.inflight.Add(1) // as begin does
	x.rt = x.snap.routes[0]
	x.rec.Series = x.snap.metrics.Series(0, 0)
	x.dialect = dialect.OpenAI
	x.tap.Start([]byte("text/event-stream"), nil, x.dialect, 1<<20, 0, x, false) // as startParsing does
	x.relay.Start(body, nil, nil, -1)
	x.tap.Sent(time.Now())
	return x
}

// The relay's per-event work (stamp the previous chunk's delivery, read,
// parse, classify, record the gap) allocates nothing in steady state.
func TestRelayNoAllocsPerEvent(t *testing.T) {
	x := streamingExchange(newProxyForBench(t), &repeatReader{benchEvent})
	buf := make([]byte, 4096)
	x.tap.Grown()
	x.relay.Read(buf)
	if a := testing.AllocsPerRun(500, func() { x.relay.Read(buf) }); a != 0 {
		t.Fatalf("allocs per relayed event = %v, want 0", a)
	}
	if x.tap.Events() < 500 {
		t.Fatalf("events = %d: the benchmark relays nothing", x.tap.Events())
	}
}

func BenchmarkRelayPerEvent(b *testing.B) {
	x := streamingExchange(newProxyForBench(b), &repeatReader{benchEvent})
	buf := make([]byte, 4096)
	b.ReportAllocs()
	b.SetBytes(int64(len(benchEvent)))
	for b.Loop() {
		x.relay.Read(buf)
	}
}

// BenchmarkFinishRecord measures finishing one streamed request: deriving
// the record, metrics, the access log queue, and returning the exchange.
func BenchmarkFinishRecord(b *testing.B) {
	alog := metrics.NewAccessLog(zapcore.AddSync(io.Discard), 1<<16)
	defer alog.Close()
	p := newProxyForBench(b, alog)
	buf := make([]byte, 4096)
	b.ReportAllocs()
	for b.Loop() {
		x := streamingExchange(p, &repeatReader{benchEvent})
		for range 20 {
			x.relay.Read(buf)
		}
		x.Finish(nil)
	}
}

// countingReader returns the same chunk n times, then io.EOF.
type countingReader struct {
	chunk []byte
	n     int
}

func (r *countingReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		return 0, io.EOF
	}
	r.n--
	return copy(p, r.chunk), nil
}

// BenchmarkRelayWriteTo is the chunked relay as fasthttp drives it: one
// upstream read, parse and flushed client write per event.
func BenchmarkRelayWriteTo(b *testing.B) {
	x := streamingExchange(newProxyForBench(b), &countingReader{chunk: benchEvent, n: b.N})
	x.tap.Grown()
	b.ReportAllocs()
	b.SetBytes(int64(len(benchEvent)))
	b.ResetTimer()
	if _, err := x.relay.WriteTo(io.Discard); err != nil {
		b.Fatal(err)
	}
}

// passPair returns an exchange relaying a chunked body with passChunks
// from a loopback upstream socket to a loopback client socket whose peer
// reads everything, and the upstream's writing end.
func passPair(tb testing.TB) (*exchange, net.Conn) {
	tb.Helper()
	p := newProxyForBench(tb)
	upWrite, upRead := tcpPair(tb)
	clPeer, cl := tcpPair(tb)
	go io.Copy(io.Discard, clPeer)
	x := streamingExchange(p, nil)
	x.att.up = x.rt.set.Members()[0].Up
	x.att.conn = x.att.up.Wrap(upRead, false)
	x.client = cl
	x.relay.Start(nil, x.att.conn, x.client, -1)
	x.tap.Grown()
	return x, upWrite
}

var benchFrame = []byte(fmt.Sprintf("%x\r\n%s\r\n", len(benchEvent), benchEvent))

// The chunked relay (passChunks), one upstream read, parse and client
// write per event, allocates nothing in steady state.
func TestPassChunksNoAllocsPerEvent(t *testing.T) {
	x, up := passPair(t)
	step := func() {
		if _, err := up.Write(benchFrame); err != nil {
			t.Fatal(err)
		}
		if end, err := x.relay.PassRead(); end {
			t.Fatalf("the relay ended: %v", err)
		}
	}
	step()
	if a := testing.AllocsPerRun(500, step); a != 0 {
		t.Fatalf("allocs per relayed event = %v, want 0", a)
	}
	if x.tap.Events() < 500 || x.relay.BytesOut() < 500*int64(len(benchEvent)) {
		t.Fatalf("%d events, %d bytes relayed: the test relays nothing", x.tap.Events(), x.relay.BytesOut())
	}
}

// BenchmarkPassChunks is the chunked relay per event over loopback
// sockets: the upstream's write, tokentap's read, parse and client write,
// the client's read.
func BenchmarkPassChunks(b *testing.B) {
	x, up := passPair(b)
	b.ReportAllocs()
	b.SetBytes(int64(len(benchEvent)))
	for b.Loop() {
		up.Write(benchFrame)
		x.relay.PassRead()
	}
}

// relayPair is passPair with the client side a clientConn and the
// upstream's receive stamps on, as the proxy's own connections are, so
// that passChunks hands the stream to a relay loop unless goroutine is
// set. peer is the client's end.
func relayPair(tb testing.TB, goroutine bool) (x *exchange, up, peer net.Conn) {
	tb.Helper()
	p := newProxyForBench(tb)
	p.opts.GoroutineRelay = goroutine
	if !goroutine {
		// The loops Serve would start.
		p.loops.Start(runtime.GOMAXPROCS(0), p.now)
		tb.Cleanup(p.loops.Stop)
	}
	upWrite, upRead := tcpPair(tb)
	peer, cl := tcpPair(tb)
	x = streamingExchange(p, nil)
	x.att.up = x.rt.set.Members()[0].Up
	x.att.conn = x.att.up.Wrap(upRead, true)
	x.client = downstream.NewConn(cl, time.Minute)
	x.relay.Start(nil, x.att.conn, x.client, -1)
	x.tap.Grown()
	return x, upWrite, peer
}

// passWhole relays x's chunked body with passChunks, as a hijack's
// goroutine would with no server around, and returns how it ended, on a
// relay loop or not.
func passWhole(x *exchange) error {
	return x.relay.Pass()
}

// relayOne sends one chunk frame upstream and reads it whole at the client.
func relayOne(tb testing.TB, up, peer net.Conn, got []byte) {
	if _, err := up.Write(benchFrame); err != nil {
		tb.Fatal(err)
	}
	if _, err := io.ReadFull(peer, got); err != nil {
		tb.Fatal(err)
	}
}

// A stream on a relay loop: each event is relayed byte for byte with no
// allocation (the loop's goroutine included: AllocsPerRun counts the whole
// process), and the end of the body ends the stream cleanly.
func TestRelayLoopNoAllocsPerEvent(t *testing.T) {
	x, up, peer := relayPair(t, false)
	before := x.p.loops.Streams()
	done := make(chan error, 1)
	go func() { done <- passWhole(x) }()
	got := make([]byte, len(benchFrame))
	relayOne(t, up, peer, got)
	if a := testing.AllocsPerRun(500, func() { relayOne(t, up, peer, got) }); a != 0 {
		t.Fatalf("allocs per relayed event = %v, want 0", a)
	}
	if !bytes.Equal(got, benchFrame) {
		t.Fatalf("the client read %q, want %q", got, benchFrame)
	}
	if _, err := io.WriteString(up, "0\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("the stream ended with %v", err)
	}
	if x.p.loops.Streams() == before {
		t.Fatal("the stream was not relayed by a relay loop")
	}
	if x.tap.Events() != 502 || x.relay.BytesOut() != 502*int64(len(benchEvent)) || x.relay.ReadErr() != io.EOF {
		t.Fatalf("%d events, %d bytes relayed, ended with %v", x.tap.Events(), x.relay.BytesOut(), x.relay.ReadErr())
	}
}

// BenchmarkRelayPath is one event through an established stream over
// loopback sockets, the backend's write to the client's read, on a relay
// loop and on the stream's own goroutine.
func BenchmarkRelayPath(b *testing.B) {
	for _, path := range relayPaths {
		b.Run(path.name, func(b *testing.B) {
			x, up, peer := relayPair(b, path.goroutine)
			done := make(chan error, 1)
			go func() { done <- passWhole(x) }()
			got := make([]byte, len(benchFrame))
			b.ReportAllocs()
			b.SetBytes(int64(len(benchEvent)))
			for b.Loop() {
				relayOne(b, up, peer, got)
			}
			io.WriteString(up, "0\r\n\r\n")
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		})
	}
}
