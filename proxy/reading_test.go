package proxy

import (
	"bufio"
	"bytes"
	"context"
	"math"
	"net"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/measure"
	"github.com/tokentap/tokentap/proxy/testkit/netsim"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// A stream's script: when the upstream sends each token (from when it got
// the request; tokens at the same time go in one write), with pad bytes of
// text in each.
type tokenScript struct {
	at  []time.Duration
	pad int
}

// readingDialect writes a stream's token events and its end in one
// dialect's shape; each token's text holds "tok".
type readingDialect struct {
	name, path, ctype, body string
	token                   func(text string) string
	end                     string
}

var readingDialects = []readingDialect{
	{"openai", "/v1/chat/completions", "text/event-stream", `{"model":"m","stream":true}`,
		func(s string) string {
			return `data: {"choices":[{"index":0,"delta":{"content":"` + s + `"}}]}` + "\n\n"
		},
		"data: [DONE]\n\n"},
	{"anthropic", "/v1/messages", "text/event-stream", `{"model":"m","stream":true,"max_tokens":100}`,
		func(s string) string {
			return "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"" + s + "\"}}\n\n"
		},
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"},
	{"ollama", "/api/chat", "application/x-ndjson", `{"model":"m"}`,
		func(s string) string {
			return `{"model":"m","message":{"role":"assistant","content":"` + s + `"},"done":false}` + "\n"
		},
		`{"model":"m","message":{"role":"assistant","content":""},"done":true,"eval_count":1}` + "\n"},
}

// scriptedStream serves the script in the dialect.
func scriptedStream(d readingDialect, s tokenScript) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		w.Header().Set("Content-Type", d.ctype)
		w.WriteHeader(200)
		flush(w)
		text := "tok" + strings.Repeat("x", s.pad)
		for i := 0; i < len(s.at); {
			time.Sleep(time.Until(start.Add(s.at[i])))
			var b strings.Builder
			j := i
			for ; j < len(s.at) && s.at[j] == s.at[i]; j++ {
				b.WriteString(d.token(text))
			}
			if _, err := w.Write([]byte(b.String())); err != nil {
				return
			}
			flush(w)
			i = j
		}
		w.Write([]byte(d.end))
	}
}

// readTokensAt sends the request on a fresh connection (with a receive
// buffer of rcvbuf bytes when not 0) and returns when each token reached
// the client, from just before it sent the request, on its own clock;
// after pauseAfter tokens (when not 0) it stops reading for pause.
func readTokensAt(t *testing.T, addr string, d readingDialect, rcvbuf, pauseAfter int, pause time.Duration) []time.Duration {
	t.Helper()
	dialer := net.Dialer{}
	if rcvbuf > 0 {
		dialer.Control = func(_, _ string, c syscall.RawConn) error {
			var serr error
			err := c.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf) })
			if err != nil {
				return err
			}
			return serr
		}
	}
	c, err := dialer.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return readTokensOn(t, c, d, pauseAfter, pause)
}

// readTokensOn is readTokensAt on a connection made (c, closed at the end).
func readTokensOn(t *testing.T, c net.Conn, d readingDialect, pauseAfter int, pause time.Duration) []time.Duration {
	t.Helper()
	defer c.Close()
	req, _ := http.NewRequest("POST", "http://tokentap.test"+d.path, strings.NewReader(d.body))
	req.Header.Set("Content-Type", "application/json")
	var raw bytes.Buffer
	req.Write(&raw)
	br := bufio.NewReaderSize(c, 1<<20)
	s := time.Now()
	if _, err := c.Write(raw.Bytes()); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body := bufio.NewReaderSize(resp.Body, 1<<20)
	var at []time.Duration
	for {
		line, err := body.ReadSlice('\n')
		if bytes.Contains(line, []byte("tok")) {
			at = append(at, time.Since(s))
			if pauseAfter > 0 && len(at) == pauseAfter {
				time.Sleep(pause)
			}
		}
		if err != nil {
			break
		}
	}
	return at
}

// tokensEvery is n tokens' times, the first at first, then gap apart.
func tokensEvery(n int, first, gap time.Duration) []time.Duration {
	a := make([]time.Duration, n)
	for i := range a {
		a[i] = first + time.Duration(i)*gap
	}
	return a
}

// TestStreamsReadAsTheirClientsRead: for streams of every shape a reader
// tells apart, in every streaming dialect, the record's reading agrees with
// the reader model computed from the client's own clock: fluidity within
// 0.05, qoe within 0.03, stall_ms within max(15 ms, 5%), stalls exact,
// and the hop that held the tokens named.
func TestStreamsReadAsTheirClientsRead(t *testing.T) {
	wait.Long(t, "streams of nine shapes in three dialects, scripted to the millisecond (about 40 s)")
	pace := measure.Pace{TTFT: time.Second, Read: 50 * time.Millisecond}
	burst := func(bursts, size int, first, gap time.Duration) []time.Duration {
		var a []time.Duration
		for b := range bursts {
			for range size {
				a = append(a, first+time.Duration(b)*gap)
			}
		}
		return a
	}
	longStall := append(tokensEvery(15, 50*time.Millisecond, 10*time.Millisecond), tokensEvery(15, 2500*time.Millisecond, 10*time.Millisecond)...)
	starve := append(burst(1, 20, 50*time.Millisecond, 0), tokensEvery(5, 600*time.Millisecond, 400*time.Millisecond)...)
	type shape struct {
		name   string
		script tokenScript
		held   metrics.Hop
		qoe1   bool
		// The client: its receive buffer, and a pause after some tokens.
		rcvbuf, pauseAfter int
		pause              time.Duration
		// hold: tokentap holds each read carrying this token's index (a
		// test build's gateway delay), for holdFor.
		hold    int
		holdFor time.Duration
	}
	shapes := []shape{
		{name: "smooth", script: tokenScript{at: tokensEvery(30, 50*time.Millisecond, 10*time.Millisecond)}, qoe1: true},
		{name: "one long stall", script: tokenScript{at: longStall}, held: metrics.HopUpstream},
		{name: "late first token", script: tokenScript{at: tokensEvery(10, 1500*time.Millisecond, 10*time.Millisecond)}},
		{name: "every gap over the pace", script: tokenScript{at: tokensEvery(10, 50*time.Millisecond, 150*time.Millisecond)}, held: metrics.HopUpstream},
		{name: "bursts", script: tokenScript{at: burst(4, 6, 50*time.Millisecond, 700*time.Millisecond)}, held: metrics.HopUpstream},
		{name: "early burst then starving", script: tokenScript{at: starve}, held: metrics.HopUpstream},
		{name: "gateway holds", script: tokenScript{at: tokensEvery(20, 50*time.Millisecond, 20*time.Millisecond)}, held: metrics.HopGateway,
			qoe1: true, hold: 10, holdFor: 600 * time.Millisecond},
		{name: "slow reader", script: tokenScript{at: tokensEvery(30, 50*time.Millisecond, 10*time.Millisecond), pad: 8 << 10}, held: metrics.HopClient,
			rcvbuf: 4096, pauseAfter: 5, pause: 1200 * time.Millisecond},
	}
	for _, d := range readingDialects {
		for _, sh := range shapes {
			t.Run(d.name+"/"+sh.name, func(t *testing.T) {
				up := startUpstream(t, scriptedStream(d, sh.script))
				tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].QoE = pace })
				if sh.holdFor > 0 {
					seen := 0
					h := func(b []byte) {
						if n := bytes.Count(b, []byte("tok")); n > 0 {
							if seen <= sh.hold && seen+n > sh.hold {
								time.Sleep(sh.holdFor)
							}
							seen += n
						}
					}
					holdRead.Store(&h)
					t.Cleanup(func() { holdRead.Store(nil) })
				}
				at := readTokensAt(t, tp.addr, d, sh.rcvbuf, sh.pauseAfter, sh.pause)
				r := tp.rec.next(t)
				if len(at) != len(sh.script.at) {
					t.Fatalf("the client read %d tokens of %d", len(at), len(sh.script.at))
				}
				checkReading(t, r, measure.ReadingOf(at, pace), sh.held)
				if got := r.Reading.QoE == 1; got != sh.qoe1 && sh.qoe1 {
					t.Errorf("qoe %.3f, want 1", r.Reading.QoE)
				}
			})
		}
	}
}

// checkReading compares a record's reading with the client's own.
func checkReading(t *testing.T, r metrics.Record, want metrics.Reading, held metrics.Hop) {
	t.Helper()
	got := r.Reading
	t.Logf("record: %+v (client_ttft %v)\nclient: %+v", got, r.ClientTTFT, want)
	tol := max(15*time.Millisecond, want.Stall/20)
	switch {
	case got.Tokens != want.Tokens:
		t.Errorf("%d tokens read, the client read %d", got.Tokens, want.Tokens)
	case math.Abs(got.Fluidity-want.Fluidity) > 0.05:
		t.Errorf("fluidity %.3f, the client's %.3f", got.Fluidity, want.Fluidity)
	case math.Abs(got.QoE-want.QoE) > 0.03:
		t.Errorf("qoe %.3f, the client's %.3f", got.QoE, want.QoE)
	case (got.Stall - want.Stall).Abs() > tol:
		t.Errorf("stall %v, the client's %v (within %v)", got.Stall, want.Stall, tol)
	case got.Stalls != want.Stalls:
		t.Errorf("%d stalls, the client's %d", got.Stalls, want.Stalls)
	case got.HeldBy != held:
		t.Errorf("held by %q, want %q", got.HeldBy, held)
	}
	if (got.Stall > 0) != (got.HeldBy != metrics.HopNone) {
		t.Errorf("stall %v held by %q: a hop is named exactly when the reader waited", got.Stall, got.HeldBy)
	}
}

// TestStreamsReadAcrossADelayLink: the same agreement with the client
// across a real link, 10 ms each way, and behind a 32 KiB/s bottleneck
// (network namespaces and a forwarder: netsim), streams of the shapes a
// reader tells apart, against the client's own clock.
func TestStreamsReadAcrossADelayLink(t *testing.T) {
	wait.Long(t, "streams of four shapes over two delayed links in network namespaces")
	if err := netsim.Available(); err != nil {
		t.Skip("no delay link on this machine:", err)
	}
	pace := measure.Pace{TTFT: time.Second, Read: 50 * time.Millisecond}
	var burst []time.Duration
	for b := range 4 {
		for range 6 {
			burst = append(burst, 50*time.Millisecond+time.Duration(b)*700*time.Millisecond)
		}
	}
	shapes := []struct {
		name string
		at   []time.Duration
	}{
		{"smooth", tokensEvery(20, 50*time.Millisecond, 10*time.Millisecond)},
		{"one long stall", append(tokensEvery(10, 50*time.Millisecond, 10*time.Millisecond), tokensEvery(10, 2*time.Second, 10*time.Millisecond)...)},
		{"late first token", tokensEvery(10, 1500*time.Millisecond, 10*time.Millisecond)},
		{"bursts", burst},
	}
	d := readingDialects[0]
	for _, lo := range []struct {
		name string
		o    netsim.Options
	}{{"10ms", netsim.Options{Delay: 10 * time.Millisecond, Seed: 11}}, {"10ms, 32 KiB/s", netsim.Options{Delay: 10 * time.Millisecond, Rate: 32 << 10, Seed: 12}}} {
		link, err := netsim.New(lo.o)
		if err != nil {
			t.Fatal(err)
		}
		for _, sh := range shapes {
			t.Run(lo.name+"/"+sh.name, func(t *testing.T) {
				up := startUpstream(t, scriptedStream(d, tokenScript{at: sh.at}))
				rec := newRecorder()
				p, err := New(Config{Routes: []Route{{Name: "chat", Prefix: "/", Upstream: up.URL, Timeouts: DefaultTimeouts, QoE: pace}}}, Options{Sinks: []metrics.Sink{rec}})
				if err != nil {
					t.Fatal(err)
				}
				var ln net.Listener
				if err := link.A.Do(func() (err error) { ln, err = p.Listen("10.77.0.1:0"); return err }); err != nil {
					t.Fatal(err)
				}
				go func() { _ = p.Serve(ln) }()
				defer p.Close()
				c, err := link.B.Dial(context.Background(), "tcp", ln.Addr().String())
				if err != nil {
					t.Fatal(err)
				}
				at := readTokensOn(t, c, d, 0, 0)
				r := rec.next(t)
				if len(at) != len(sh.at) {
					t.Fatalf("the client read %d tokens of %d", len(at), len(sh.at))
				}
				held := metrics.HopUpstream
				if sh.name == "smooth" || sh.name == "late first token" {
					held = metrics.HopNone
				}
				checkReading(t, r, measure.ReadingOf(at, pace), held)
			})
		}
		if err := link.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
