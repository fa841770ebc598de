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
