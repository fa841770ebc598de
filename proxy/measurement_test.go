package proxy

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
)

// Each measuring feature an operator can turn off (measurement: in the
// config) is off when asked, and only it: the live stats engine is fed
// nothing, the route's Prometheus series are not made, the record has no
// client-side figures. With all on (the control), each is there. The
// record itself, its outcome and its server-side timings stay.
func TestMeasurementSwitches(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for k := range 3 {
			io.WriteString(w, chatChunk(itoa(k)))
			flush(w)
			time.Sleep(5 * time.Millisecond)
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	cases := []struct {
		name string
		opts Options
	}{
		{"measure-all", Options{}},
		{"measure-nostats", Options{NoStats: true}},
		{"measure-noseries", Options{NoSeries: true}},
		{"measure-noclientside", Options{NoClientSide: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tp := startProxyOpts(t, up.URL, func(cfg *Config) { cfg.Routes[0].Name = c.name }, c.opts)
			conn, br := rawRequest(t, tp.addr, postJSON("/v1/chat/completions", `{"model":"m","stream":true}`))
			defer conn.Close()
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := io.ReadAll(resp.Body); !strings.Contains(string(b), "[DONE]") {
				t.Fatalf("body %q", b)
			}
			rec := tp.rec.next(t)
			if rec.Outcome != metrics.OutcomeOK || rec.Events != 3 || rec.TTFT < 0 {
				t.Fatalf("record: %s, %d events, ttft %v", rec.Outcome, rec.Events, rec.TTFT)
			}
			if tp.p.StatsOff() != c.opts.NoStats {
				t.Fatalf("StatsOff = %v", tp.p.StatsOff())
			}
			fed := len(tp.p.Stats().Query(stats.Query{Window: "all", Route: c.name}).Groups) > 0
			if fed == c.opts.NoStats {
				t.Errorf("the live stats fed: %v, want %v", fed, !c.opts.NoStats)
			}
			var prom bytes.Buffer
			metrics.WritePrometheus(&prom, false)
			series := strings.Contains(prom.String(), `route="`+c.name+`"`)
			if series == c.opts.NoSeries {
				t.Errorf("the route's Prometheus series: %v, want %v", series, !c.opts.NoSeries)
			}
			client := rec.ClientRTT >= 0 && rec.ClientTTFT >= 0 && rec.BytesWire > 0
			if client == c.opts.NoClientSide {
				t.Errorf("client-side figures: %v (rtt %v, client ttft %v, %d bytes on the wire), want %v",
					client, rec.ClientRTT, rec.ClientTTFT, rec.BytesWire, !c.opts.NoClientSide)
			}
		})
	}
}

// A request whose first bytes came in well before its last is timed from its
// first byte, as its client times it: the arrival is the kernel's, not the
// moment tokentap had the whole request.
func TestArrivalIsFirstByte(t *testing.T) {
	stampsOn(t)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, chatChunk("hi"))
		io.WriteString(w, "data: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	body := `{"model":"m","stream":true}`
	req := postJSON("/v1/chat/completions", body)
	head := req[:len(req)-len(body)]
	c, br := rawRequest(t, tp.addr, head)
	const hold = 80 * time.Millisecond
	time.Sleep(hold)
	io.WriteString(c, body)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	if !strings.Contains(string(b), "[DONE]") {
		t.Fatalf("body %q", b)
	}
	rec := tp.rec.next(t)
	// The client lived the wait (TTFT, E2E); it was the client's own, so
	// it is reported as the upload, not as tokentap's overhead.
	if rec.TTFT < hold || rec.E2E < hold || rec.Upload < hold || rec.Overhead >= hold {
		t.Fatalf("ttft=%v e2e=%v upload=%v overhead=%v: the %v between the first and last byte of the request are misplaced",
			rec.TTFT, rec.E2E, rec.Upload, rec.Overhead, hold)
	}

	// The next request on the same connection is timed from its own bytes.
	io.WriteString(c, req)
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	if rec := tp.rec.next(t); rec.TTFT >= hold {
		t.Fatalf("second request ttft=%v: timed from the first request's bytes", rec.TTFT)
	}
}
