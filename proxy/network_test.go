//go:build linux

package proxy

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/netsim"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"github.com/tokentap/tokentap/ratelimit"
)

// clientTimes is what a client on the far side of the link measured: from
// start, on its connection's local port.
type clientTimes struct {
	ttft, e2e time.Duration
	start     time.Time
	port      uint16
	// Where the request, the first token and the response's last byte are
	// in the connection's streams (0: its first byte), and how many bytes
	// each way the exchange took: the link finds when they crossed the
	// client's device (netsim.Link.WireTime).
	reqOff, tokOff, endOff int64
	sent, got              int64
}

// streamOver sends one streamed chat on c and measures, from just before
// the request is written: the first token's arrival and the response's
// last byte.
func streamOver(c net.Conn, id string) (clientTimes, error) {
	body := `{"model":"m","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	req := "POST /v1/chat/completions HTTP/1.1\r\nHost: tokentap\r\nContent-Type: application/json\r\nX-Request-Id: " + id +
		"\r\nContent-Length: " + itoa(len(body)) + "\r\n\r\n" + body
	ct := clientTimes{port: uint16(c.LocalAddr().(*net.TCPAddr).Port), sent: int64(len(req))}
	start := time.Now()
	ct.start = start
	if _, err := c.Write([]byte(req)); err != nil {
		return ct, err
	}
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var got []byte
	buf := make([]byte, 16<<10)
	for {
		n, err := c.Read(buf)
		at := time.Since(start)
		got = append(got, buf[:n]...)
		// The first token: the first chunk with a content that is not
		// empty (mockllm's first chunk has an empty one), as tokentap's
		// dialect counts it.
		if ct.ttft == 0 {
			if i := firstContent(got); i >= 0 {
				ct.ttft, ct.tokOff = at, int64(i)
			}
		}
		if bytes.HasSuffix(got, []byte("\r\n0\r\n\r\n")) {
			ct.e2e = at
			ct.endOff, ct.got = int64(len(got)-1), int64(len(got))
			return ct, nil
		}
		if err != nil {
			return ct, fmt.Errorf("after %d bytes: %w", len(got), err)
		}
	}
}

// firstContent returns where the first non-empty "content" string begins
// in b, or -1.
func firstContent(b []byte) int {
	key := []byte(`"content":"`)
	for off := 0; ; {
		i := bytes.Index(b[off:], key)
		if i < 0 {
			return -1
		}
		at := off + i + len(key)
		if at < len(b) && b[at] != '"' {
			return at
		}
		off = at
	}
}

// The clients run in a process of their own inside the link's far
// namespace: inside the test's process their reads would wait for the Go
// scheduler behind tokentap's goroutines (milliseconds on a busy
// machine), and their own clocks would be the least accurate part of the
// comparison. Each worker's thread runs at a real-time priority where
// the system allows it.
const envNetClients = "TOKENTAP_NETCLIENTS"

// serveNetClients runs the clients when this process was started as
// them (addr,workers,per-worker,fresh), prints "id ttft_ns e2e_ns
// start_unix_ns port" per request and exits; otherwise it returns.
func serveNetClients() {
	spec := os.Getenv(envNetClients)
	if spec == "" {
		return
	}
	var addr, mode string
	var workers, per int
	if _, err := fmt.Sscanf(strings.ReplaceAll(spec, ",", " "), "%s %d %d %s", &addr, &workers, &per, &mode); err != nil {
		fmt.Fprintln(os.Stderr, "netclients:", err)
		os.Exit(2)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	failed := false
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			netsim.Realtime()
			if mode == "h2" {
				runH2Clients(w, per, addr, &mu, &failed)
				return
			}
			fresh := mode == "fresh"
			var c net.Conn
			var sent, got int64 // on c so far
			for i := range per {
				if c == nil {
					sent, got = 0, 0
					var err error
					if c, err = net.Dial("tcp", addr); err != nil {
						fmt.Fprintln(os.Stderr, "netclients:", err)
						failed = true
						return
					}
				}
				id := fmt.Sprintf("%s-w%d-%d", map[bool]string{true: "fresh", false: "kept"}[fresh], w, i)
				ct, err := streamOver(c, id)
				if err != nil {
					fmt.Fprintln(os.Stderr, "netclients:", id, err)
					failed = true
					return
				}
				ct.reqOff, ct.tokOff, ct.endOff = sent, got+ct.tokOff, got+ct.endOff
				sent, got = sent+ct.sent, got+ct.got
				mu.Lock()
				fmt.Printf("%s %d %d %d %d %d %d %d\n", id, ct.ttft, ct.e2e, ct.start.UnixNano(), ct.port, ct.reqOff, ct.tokOff, ct.endOff)
				mu.Unlock()
				if fresh {
					c.Close()
					c = nil
				}
			}
			if c != nil {
				c.Close()
			}
		}()
	}
	wg.Wait()
	if failed {
		os.Exit(1)
	}
	os.Exit(0)
}

// runNetClients runs workers × per requests from inside ns against addr,
// on fresh connections, one kept-alive connection per worker, or one
// HTTP/2 connection per worker (mode: fresh, kept, h2), and returns what
// each client measured, by request id. It may run on any goroutine (it
// reports with t.Error).
func runNetClients(t *testing.T, ns *netsim.NS, addr string, workers, per int, mode string) map[string]clientTimes {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s,%d,%d,%s", envNetClients, addr, workers, per, mode), "GOMAXPROCS=4")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	got := map[string]clientTimes{}
	if err := ns.Start(cmd); err != nil {
		t.Error(err)
		return got
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("clients: %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		var id string
		var ttft, e2e, start, reqOff, tokOff, endOff int64
		var port uint16
		if _, err := fmt.Sscan(line, &id, &ttft, &e2e, &start, &port, &reqOff, &tokOff, &endOff); err != nil {
			t.Errorf("clients printed %q: %v", line, err)
			continue
		}
		got[id] = clientTimes{ttft: time.Duration(ttft), e2e: time.Duration(e2e), start: time.Unix(0, start), port: port,
			reqOff: reqOff, tokOff: tokOff, endOff: endOff}
	}
	return got
}

// TestClientSideTimesOverADelayLink runs tokentap in one network namespace
// and real clients in another, joined by a link that delays each packet
// (netsim), and compares the record's client_ttft_ms and client_e2e_ms
// with what the clients measured, over fresh and kept-alive connections,
// at 5, 20 and 100 ms one way, with and without 1% loss. The median error
// must be under ttft_ms's own (which lacks the network: 10 ms and more),
// whatever a busy machine adds to both; with TOKENTAP_NETWORK_STRICT=1 (on an otherwise idle machine; 100
// requests per row instead of 20) the p99 must be under 2 ms. With loss it is reported. TOKENTAP_NETWORK_REPORT=
// FILE writes the table (README's); TOKENTAP_NETWORK_QUEUED=1 runs the links with a bottleneck only. The backend
// runs on the process's own loopback (tokentap's dials come from the
// process's namespace): no delay between the two, as in a deployment
// beside the backend.
func TestClientSideTimesOverADelayLink(t *testing.T) {
	wait.Long(t, "streams over delayed links in network namespaces")
	if err := netsim.Available(); err != nil {
		t.Skip("no delay link on this machine:", err)
	}
	up := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: 4 * time.Millisecond})
	// A slow model (a token every 60 ms): a kept-alive client that holds
	// its acknowledgement of a lone token until its timer runs out (40 ms
	// on Linux) made client_ttft_ms 41 ms too long at the median, on a path
	// with no queue (ackMark.delayed).
	slow := startMock(t, mockllm.Options{PrefillBase: 10 * time.Millisecond, TokenGap: 60 * time.Millisecond, MaxTokens: 3})
	strict := os.Getenv("TOKENTAP_NETWORK_STRICT") != ""
	queuedOnly := os.Getenv("TOKENTAP_NETWORK_QUEUED") != ""
	type row struct {
		link                   string
		delay                  time.Duration
		loss                   float64
		conn                   string
		n                      int
		ttft50, ttft99, e2e50  float64
		e2e99, clientTTFT50    float64
		retransmitted, unacked int
		naive50                float64 // the median error of ttft_ms alone
		// The same over the requests whose packets the link released on
		// time (none netsim.LateBy or more past its delay; a p99 of fewer
		// than 100 is their largest): late counts the others.
		late                      int
		ttft99OnTime, e2e99OnTime float64
		queued                    bool // a bottleneck towards the clients
		slow                      bool // a token every 60 ms
		off20, off10              int  // requests whose client TTFT was off by 20, by 10 ms or more
	}
	var rows []row
	type netLink struct {
		netsim.Options
		slow bool
	}
	var links []netLink
	for _, delay := range []time.Duration{5 * time.Millisecond, 20 * time.Millisecond, 100 * time.Millisecond} {
		for _, loss := range []float64{0, 0.01} {
			links = append(links, netLink{Options: netsim.Options{Delay: delay, Loss: loss, Seed: uint64(delay) + 1}})
		}
	}
	links = append(links, netLink{Options: netsim.Options{Delay: 20 * time.Millisecond, Seed: 21}, slow: true})
	// A path slower than its minimum: jitter both ways, and a bottleneck
	// towards the clients (32 KiB/s) that their own streams fill, so their
	// tokens queue for up to tens of milliseconds.
	links = append(links, netLink{Options: netsim.Options{Delay: 10 * time.Millisecond, Jitter: 500 * time.Microsecond, Rate: 32 << 10, Seed: 99}})
	// The same bottleneck on a short path (a client in the same network):
	// its first-token marks are first looked at a round trip and measure.AckAgree
	// after the write, and then as often as on a long one.
	links = append(links, netLink{Options: netsim.Options{Delay: 250 * time.Microsecond, Rate: 32 << 10, Seed: 98}})
	for _, lo := range links {
		if queuedOnly && lo.Rate == 0 {
			continue
		}
		{
			delay, loss := lo.Delay, lo.Loss
			link, err := netsim.New(lo.Options)
			if err != nil {
				t.Fatal(err)
			}
			rec := newRecorder()
			backend := up
			if lo.slow {
				backend = slow
			}
			p, err := New(Config{Routes: []Route{{Name: "chat", Prefix: "/", Upstream: backend, Timeouts: DefaultTimeouts}}}, Options{Sinks: []metrics.Sink{rec}})
			if err != nil {
				t.Fatal(err)
			}
			var ln net.Listener
			if err := link.A.Do(func() (err error) { ln, err = p.Listen("10.77.0.1:0"); return err }); err != nil {
				t.Fatal(err)
			}
			go func() { _ = p.Serve(ln) }()

			const workers = 2
			perWorker := 10
			if strict {
				perWorker = 50 // p99 of 100, not the largest of 20
			}
			// Fresh and kept-alive clients at once, each in its process;
			// then HTTP/2 clients (a stream at a time on a connection per
			// worker), alone: the link's queue is theirs as it was the
			// others'.
			measured := map[string]clientTimes{}
			var mu sync.Mutex
			passes := [][]string{{"fresh", "kept"}, {"h2"}}
			if !strict && lo.Loss > 0 {
				passes = passes[:1] // HTTP/2 over the lossy links when asked (strict): the suite's time
			}
			for _, modes := range passes {
				var wg sync.WaitGroup
				for _, mode := range modes {
					wg.Go(func() {
						got := runNetClients(t, link.B, ln.Addr().String(), workers, perWorker, mode)
						mu.Lock()
						maps.Copy(measured, got)
						mu.Unlock()
					})
				}
				wg.Wait()
			}
			kindOf := func(id string) string {
				switch {
				case strings.HasPrefix(id, "fresh"):
					return "fresh"
				case strings.HasPrefix(id, "h2"):
					return "HTTP/2"
				}
				return "kept-alive"
			}
			type sample struct {
				ct        clientTimes
				ttft, e2e float64 // |estimate − the client's own|
			}
			samples := map[string][]sample{}
			ttftSeen := map[string][]float64{}
			naive := map[string][]float64{} // |ttft_ms − the client's TTFT|: the error without the network
			retrans, unacked := map[string]int{}, map[string]int{}
			var recs []metrics.Record
			for range len(measured) {
				r := rec.next(t)
				if _, ok := measured[r.RequestID]; !ok {
					t.Fatalf("record of an unknown request %q", r.RequestID)
				}
				k := kindOf(r.RequestID)
				if r.ClientTTFT < 0 || r.ClientE2E < 0 || r.ClientRTT < 2*delay {
					t.Fatalf("%s: client_ttft %v client_e2e %v client_rtt %v over a %v link", r.RequestID, r.ClientTTFT, r.ClientE2E, r.ClientRTT, 2*delay)
				}
				recs = append(recs, r)
				if r.ClientRetrans > 0 {
					retrans[k]++
				}
				if r.Unacked {
					unacked[k]++
				}
				if k != "HTTP/2" && (r.BytesAcked != r.BytesWire || r.BytesWire == 0) {
					t.Errorf("%s: bytes_acked %d of %d written", r.RequestID, r.BytesAcked, r.BytesWire)
				}
			}
			_ = p.Shutdown(context.Background())
			p.Close()
			link.Close()
			// The truth is the client's device: when the request's first
			// byte left it, and when the first token's and the last byte
			// reached it (the client's own clock, which a busy machine's
			// scheduling delays, where the link did not see them).
			wired := 0
			for _, r := range recs {
				ct, k := measured[r.RequestID], kindOf(r.RequestID)
				left, ok1 := link.WireTime(ct.port, false, ct.reqOff)
				tok, ok2 := link.WireTime(ct.port, true, ct.tokOff)
				end, ok3 := link.WireTime(ct.port, true, ct.endOff)
				if ok1 && ok2 && ok3 {
					ct.ttft, ct.e2e = tok.Sub(left), end.Sub(left)
					wired++
				}
				if os.Getenv("TOKENTAP_NETWORK_DEBUG") != "" {
					t.Logf("%v loss%v %s %s: ttft est-wire %+.2f ms (est %v wire %v), e2e %+.2f ms, rtt %v srtt %v held %v ttft %v e2e %v", delay, loss, k, r.RequestID, ms(r.ClientTTFT)-ms(ct.ttft), r.ClientTTFT, ct.ttft, ms(r.ClientE2E)-ms(ct.e2e), r.ClientRTT, r.ClientSRTT, r.ClientE2E-r.E2E-r.ClientRTT, r.TTFT, r.E2E)
				}
				samples[k] = append(samples[k], sample{ct, math.Abs(ms(r.ClientTTFT) - ms(ct.ttft)), math.Abs(ms(r.ClientE2E) - ms(ct.e2e))})
				ttftSeen[k] = append(ttftSeen[k], ms(ct.ttft))
				naive[k] = append(naive[k], math.Abs(ms(r.TTFT)-ms(ct.ttft)))
			}
			if wired < len(recs)*9/10 {
				t.Errorf("%v: the link saw the packets of %d requests of %d", lo, wired, len(recs))
			}
			for _, k := range []string{"fresh", "kept-alive", "HTTP/2"} {
				if len(samples[k]) == 0 {
					continue // not run over this link
				}
				var all, onTime [2][]float64 // TTFT and E2E errors
				late := 0
				for _, s := range samples[k] {
					all[0] = append(all[0], s.ttft)
					all[1] = append(all[1], s.e2e)
					if by := link.LateOn(s.ct.port, s.ct.start, s.ct.start.Add(s.ct.e2e)); by > 0 {
						late++
						if os.Getenv("TOKENTAP_NETWORK_DEBUG") != "" {
							t.Logf("%v loss%v %s port %d: a packet released %v late; |Δ| ttft %.2f e2e %.2f ms", delay, loss, k, s.ct.port, by, s.ttft, s.e2e)
						}
						continue
					}
					onTime[0] = append(onTime[0], s.ttft)
					onTime[1] = append(onTime[1], s.e2e)
				}
				for _, v := range [][]float64{all[0], all[1], onTime[0], onTime[1]} {
					slices.Sort(v)
				}
				slices.Sort(ttftSeen[k])
				slices.Sort(naive[k])
				q := func(v []float64, p float64) float64 { return v[int(math.Ceil(p*float64(len(v))))-1] }
				name := delay.String()
				if lo.Jitter > 0 {
					name += " ± " + lo.Jitter.String()
				}
				if lo.Rate > 0 {
					name += fmt.Sprintf(", %d KiB/s", lo.Rate>>10)
				}
				if lo.slow {
					name += ", a token every 60 ms"
				}
				r := row{name, delay, loss, k, len(all[0]), q(all[0], .5), q(all[0], .99), q(all[1], .5), q(all[1], .99), q(ttftSeen[k], .5), retrans[k], unacked[k], q(naive[k], .5),
					late, math.NaN(), math.NaN(), lo.Rate > 0, lo.slow, len(all[0]) - sort.SearchFloat64s(all[0], 20), len(all[0]) - sort.SearchFloat64s(all[0], 10)}
				if len(onTime[0]) > 0 {
					r.ttft99OnTime, r.e2e99OnTime = q(onTime[0], .99), q(onTime[1], .99)
				}
				rows = append(rows, r)
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| one-way delay (jitter, bandwidth to the client) | loss | connections | requests | client TTFT p50 | \\|Δ TTFT\\| p50 | p99 | \\|Δ E2E\\| p50 | p99 | with retransmissions | link late | \\|Δ TTFT\\| p99, link on time | \\|Δ E2E\\| p99, link on time |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %v | %.0f%% | %s | %d | %.1f ms | %.2f ms | %.2f ms | %.2f ms | %.2f ms | %d | %d | %.2f ms | %.2f ms |\n",
			r.link, 100*r.loss, r.conn, r.n, r.clientTTFT50, r.ttft50, r.ttft99, r.e2e50, r.e2e99, r.retransmitted, r.late, r.ttft99OnTime, r.e2e99OnTime)
		// Without the network, ttft_ms alone is off by the round trip (10
		// ms and more here): the estimate must be nearer the client's own
		// clock, whatever the machine's load does to both. The 2 ms p99
		// target is checked when asked (strict): a busy machine's
		// scheduling shows in the clients' own clocks and in the link, not
		// only in the estimate.
		if r.ttft50 >= r.naive50 {
			t.Errorf("%v one way, %.0f%% loss, %s connections: |Δ| p50 TTFT %.2f ms, not under ttft_ms's own %.2f ms", r.delay, 100*r.loss, r.conn, r.ttft50, r.naive50)
		}
		// Behind a queue the acknowledgement of the token's bytes measures
		// the queue: 0.2-0.5 ms off at the median here on fresh connections,
		// whose client acknowledges at once (Linux's quick acknowledgements),
		// and on kept-alive ones, whose client acknowledges a lone small
		// segment late (its interactive mode) but the first write split in
		// two as it reads it (ClientSide.SplitFirst). Read with the next
		// write's acknowledgement instead (ackMark.withNext), kept-alive
		// requests were 1.3-1.7 ms off at the median and 2 to 5 of 20 a row
		// 10 ms or more (p99 21-42 ms); none of 400 since. Without them the
		// round trip's estimate is off by the queue: 29-52 ms on fresh
		// connections with a watch that ended too soon, 55-90 on kept-alive
		// ones with the next write's acknowledgement set aside.
		// A client's delayed acknowledgement of a lone token, taken for the
		// path's time, was 40-46 ms off: on about half the kept-alive
		// connections' requests (their client alternates), 0 now.
		if r.slow && r.loss == 0 && r.off20*5 > r.n {
			t.Errorf("%s, %s connections: %d of %d requests' client TTFT 20 ms or more off: a client's delayed acknowledgement taken for the path's time", r.link, r.conn, r.off20, r.n)
		}
		// An HTTP/2 stream's first tokens are watched by the
		// acknowledgement of the connection's bytes up to the end of the
		// socket write that carried them (its other streams' bytes
		// around them): behind the queue 0.5 ms off at the median, where
		// the round trip's estimate alone was 60-82 ms off.
		if r.queued && r.ttft50 >= 10 {
			t.Errorf("%s, %s connections: |Δ| p50 TTFT %.2f ms behind the queue: its acknowledgements were not used", r.link, r.conn, r.ttft50)
		}
		if r.queued && r.off10*20 > r.n {
			t.Errorf("%s, %s connections: %d of %d requests' client TTFT 10 ms or more off behind the queue", r.link, r.conn, r.off10, r.n)
		}
		// When a row misses, its requests the link carried on time (none
		// of their packets released late by the forwarder: a busy
		// machine) tell whether the link or the estimate was off.
		// Behind a queue, client_e2e_ms misses the queue's delay of the
		// last bytes (their departure, not their acknowledgement, ends
		// it: a client's delayed ACK would add up to 40 ms): the table
		// reports it, only client_ttft_ms is held to 2 ms there.
		if strict && r.loss == 0 && (r.ttft99 >= 2 || r.e2e99 >= 2 && !r.queued) {
			t.Errorf("%v one way, %s connections: |Δ| p99 TTFT %.2f ms, E2E %.2f ms: not under 2 ms (the link released packets late in %d requests; without them %.2f and %.2f ms)",
				r.delay, r.conn, r.ttft99, r.e2e99, r.late, r.ttft99OnTime, r.e2e99OnTime)
		}
		if r.unacked > 0 {
			t.Errorf("%v %s: %d records marked unacked although every client read its whole response", r.delay, r.conn, r.unacked)
		}
	}
	t.Logf("client-side estimates against the clients' own clocks:\n%s", b.String())
	if path := os.Getenv("TOKENTAP_NETWORK_REPORT"); path != "" {
		_ = os.WriteFile(path, []byte(b.String()), 0o644)
	}
}

// TestConcurrencySlotFreedWhenResponseEnds: a tenant allowed one request
// at a time sends its requests one after another on a kept-alive
// connection across a 20 ms link, each as soon as the last response ended.
// The record of each waits for the client's acknowledgement (a round trip
// after its last bytes left), but the slot is freed when the response
// ends: no request is refused.
func TestConcurrencySlotFreedWhenResponseEnds(t *testing.T) {
	wait.Long(t, "responses over a delayed link")
	if err := netsim.Available(); err != nil {
		t.Skip("no delay link on this machine:", err)
	}
	up := startMock(t, mockllm.Options{TokenGap: time.Millisecond})
	// A compressed stream's record is made on a goroutine of its own,
	// after the side decoder: its slot goes back as soon as that is done.
	gz := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "gzip")
		zw := gzip.NewWriter(w)
		for _, tok := range []string{"a", "b", "c"} {
			_, _ = io.WriteString(zw, chatChunk(tok))
			_ = zw.Flush()
			flush(w)
		}
		_, _ = io.WriteString(zw, "data: [DONE]\n\n")
		_ = zw.Close()
	})
	link, err := netsim.New(netsim.Options{Delay: 20 * time.Millisecond, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	defer link.Close()
	rec := newRecorder()
	cfg := Config{Routes: []Route{{Name: "chat", Prefix: "/", Upstream: up, Timeouts: DefaultTimeouts},
		{Name: "gz", Prefix: "/gz/", Upstream: gz.URL, Timeouts: DefaultTimeouts}}}
	withTenants(ratelimit.ModeReject, ratelimit.Tenant{Name: "a", Keys: []string{"k"}, Limits: ratelimit.Limits{MaxConcurrent: 1}})(&cfg)
	p, err := New(cfg, Options{Sinks: []metrics.Sink{rec}})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var ln net.Listener
	if err := link.A.Do(func() (err error) { ln, err = p.Listen("10.77.0.1:0"); return err }); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.Serve(ln) }()
	c, err := link.B.Dial(context.Background(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	const n = 6
	asks := []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"m","stream":true,"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`},
		{"/v1/chat/completions", `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`},
		{"/gz/v1/chat/completions", `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`},
	}
	for i := range n {
		for _, ask := range asks {
			if _, err := io.WriteString(c, postJSON(ask.path, ask.body, "Authorization: Bearer k")); err != nil {
				t.Fatal(err)
			}
			_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("request %d (%s %s): status %d, %q, %v", i, ask.path, ask.body, resp.StatusCode, b, err)
			}
		}
	}
	waited := 0
	for range len(asks) * n {
		if r := rec.next(t); r.ClientRTT >= 40*time.Millisecond && r.BytesAcked == r.BytesWire {
			waited++
		}
	}
	if waited == 0 {
		t.Fatal("no record waited for the client's acknowledgement: the test did not test")
	}
}
