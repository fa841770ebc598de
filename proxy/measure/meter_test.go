package measure

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
)

// step is one thing that happens to a meter, at a made-up time (ms after
// arrival).
type step struct {
	at   float64
	what string // "sent", "read", "token", "answer", "other", "usage", "flush"
	n    int    // usage: output tokens
}

func msAt(base time.Time, v float64) time.Time {
	return base.Add(time.Duration(v * float64(time.Millisecond)))
}

func runMeter(steps []step, queue time.Duration, streamed bool) metrics.Record {
	base := time.Unix(1_700_000_000, 0)
	var m meter
	m.reset(base)
	var rec metrics.Record
	rec.Reset()
	rec.Queue = queue
	end := base
	for _, s := range steps {
		t := msAt(base, s.at)
		end = t
		switch s.what {
		case "sent":
			m.written = t
		case "read":
			m.read(t)
		case "token":
			m.observe(dialect.Obs{Token: true}, t)
		case "answer":
			m.observe(dialect.Obs{Token: true, Answer: true}, t)
		case "other":
			m.observe(dialect.Obs{}, t)
		case "usage":
			m.observe(dialect.Obs{HasIn: true, In: 7, HasOut: true, Out: s.n}, t)
		case "flush":
			m.wrote(t)
		}
	}
	m.fill(&rec, end, streamed)
	m.finish(&rec, streamed)
	return rec
}

// The timing rules, on made-up timestamps: exact values, no clock.
func TestMeterRules(t *testing.T) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	none := time.Duration(-1)
	for _, tc := range []struct {
		name                            string
		steps                           []step
		queue                           time.Duration
		streamed                        bool
		ttft, ttfa, tpot, e2e, overhead time.Duration
		itl                             []time.Duration // count, then mean p50 p99 max
		out                             int
		source                          string
	}{
		{
			name: "a reasoning stream: TTFT at the first token, TTFA at the first answer",
			steps: []step{{at: 1, what: "sent"}, {at: 100, what: "read"}, {at: 100, what: "token"}, {at: 100.5, what: "flush"},
				{at: 120, what: "read"}, {at: 120, what: "token"}, {at: 120.2, what: "flush"},
				{at: 150, what: "read"}, {at: 150, what: "answer"}, {at: 150.3, what: "flush"},
				{at: 170, what: "read"}, {at: 170, what: "answer"}, {at: 170.5, what: "flush"}},
			streamed: true,
			ttft:     ms(100.5), ttfa: ms(150.3), e2e: ms(170.5),
			tpot:     (ms(170.5) - ms(100.5)) / 3,
			overhead: ms(1) + ms(0.5),
			// Gaps 19.7, 30.1, 20.2 ms; p99 is the gap at floor((n−1)·0.99).
			itl: []time.Duration{3, (ms(170.5) - ms(100.5)) / 3, ms(20.2), ms(20.2), ms(30.1)},
			out: 4, source: "counted",
		},
		{
			name: "tokens delivered together are gaps of 0; usage decides the output count",
			steps: []step{{at: 2, what: "sent"}, {at: 50, what: "read"}, {at: 50, what: "answer"}, {at: 50, what: "answer"}, {at: 51, what: "flush"},
				{at: 80, what: "read"}, {at: 80, what: "answer"}, {at: 80, what: "usage", n: 10}, {at: 81, what: "flush"}},
			streamed: true,
			ttft:     ms(51), ttfa: ms(51), e2e: ms(81),
			tpot:     (ms(81) - ms(51)) / 9,
			overhead: ms(2) + ms(1),
			itl:      []time.Duration{2, ms(15), 0, 0, ms(30)},
			out:      10, source: "usage",
		},
		{
			name:     "queue time is not gateway overhead",
			steps:    []step{{at: 40, what: "sent"}, {at: 60, what: "read"}, {at: 60, what: "answer"}, {at: 60.25, what: "flush"}},
			queue:    ms(39),
			streamed: true,
			ttft:     ms(60.25), ttfa: ms(60.25), e2e: ms(60.25), tpot: none,
			overhead: ms(1) + ms(0.25),
			out:      1, source: "counted",
		},
		{
			name: "events that are not tokens start nothing; the first byte stands in for overhead",
			steps: []step{{at: 1, what: "sent"}, {at: 10, what: "read"}, {at: 10, what: "other"}, {at: 10.5, what: "flush"},
				{at: 20, what: "read"}, {at: 20, what: "other"}, {at: 20.5, what: "flush"}},
			streamed: true,
			ttft:     none, ttfa: none, tpot: none, e2e: ms(20.5),
			overhead: ms(1) + ms(0.5),
		},
		{
			name:  "a body has no token timings",
			steps: []step{{at: 3, what: "sent"}, {at: 30, what: "read"}, {at: 31, what: "flush"}, {at: 31, what: "usage", n: 5}},
			ttft:  none, ttfa: none, tpot: none, e2e: ms(31),
			overhead: ms(3) + ms(1),
			out:      5, source: "usage",
		},
		{
			name:  "refused before forwarding: no overhead, E2E to the end",
			steps: []step{{at: 0.4, what: "other"}},
			ttft:  none, ttfa: none, tpot: none, e2e: ms(0.4), overhead: none,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := runMeter(tc.steps, tc.queue, tc.streamed)
			check := func(what string, got, want time.Duration) {
				t.Helper()
				if got != want {
					t.Errorf("%s = %v, want %v", what, got, want)
				}
			}
			check("ttft", rec.TTFT, tc.ttft)
			check("ttfa", rec.TTFA, tc.ttfa)
			check("tpot", rec.TPOT, tc.tpot)
			check("e2e", rec.E2E, tc.e2e)
			check("overhead", rec.Overhead, tc.overhead)
			if len(tc.itl) > 0 {
				if rec.ITLCount != int(tc.itl[0]) {
					t.Errorf("itl count = %d, want %d", rec.ITLCount, tc.itl[0])
				}
				check("itl mean", rec.ITLMean, tc.itl[1])
				check("itl p50", rec.ITLP50, tc.itl[2])
				check("itl p99", rec.ITLP99, tc.itl[3])
				check("itl max", rec.ITLMax, tc.itl[4])
			} else if rec.ITLCount != 0 {
				t.Errorf("itl count = %d, want 0", rec.ITLCount)
			}
			if rec.OutputTokens != tc.out || rec.TokensSource != tc.source {
				t.Errorf("output %d (%q), want %d (%q)", rec.OutputTokens, rec.TokensSource, tc.out, tc.source)
			}
		})
	}
}

// A token observed in a chunk whose write failed is counted, never
// delivered.
func TestMeterDroppedChunk(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	var m meter
	m.reset(base)
	m.observe(dialect.Obs{Token: true}, base.Add(time.Millisecond))
	m.drop()
	m.wrote(base.Add(2 * time.Millisecond))
	var rec metrics.Record
	rec.Reset()
	m.fill(&rec, base.Add(3*time.Millisecond), true)
	m.finish(&rec, true)
	if rec.Events != 1 || rec.TTFT != -1 {
		t.Fatalf("events %d ttft %v", rec.Events, rec.TTFT)
	}
}

// fixture is the expected half of each sse/dialect/testdata fixture
// (NAME.want.json beside NAME.sse, NAME.ndjson or NAME.json): what the
// recorded response says once measured.
type fixture struct {
	Path             string   `json:"path"`
	Framing          string   `json:"framing"`
	Dialect          string   `json:"dialect"`
	Events           int      `json:"events,omitempty"`
	TokenEvents      int      `json:"token_events,omitempty"`
	AnswerEvents     int      `json:"answer_events,omitempty"`
	FirstTokenEvent  *int     `json:"first_token_event,omitempty"`
	FirstAnswerEvent *int     `json:"first_answer_event,omitempty"`
	InputTokens      *int     `json:"input_tokens,omitempty"`
	OutputTokens     *int     `json:"output_tokens,omitempty"`
	Items            int      `json:"items,omitempty"`
	Error            bool     `json:"error"`
	ServerQueueMs    *float64 `json:"server_queue_ms,omitempty"`
	ServerLoadMs     *float64 `json:"server_load_ms,omitempty"`
	ServerPrefillMs  *float64 `json:"server_prefill_ms,omitempty"`
	ServerDecodeMs   *float64 `json:"server_decode_ms,omitempty"`
	ServerTTFTMs     *float64 `json:"server_ttft_ms,omitempty"`
}

// replayFixture runs a recorded response through the framing, the dialect
// and the meter, fed in the given pieces: event i is read and delivered at
// i ms, so the first token and answer events are read back from TTFT and
// TTFA.
func replayFixture(want fixture, pieces [][]byte) fixture {
	d := dialect.ForPath([]byte(want.Path))
	got := fixture{Path: want.Path, Framing: want.Framing, Dialect: d.Name()}
	base := time.Unix(1_700_000_000, 0)
	var m meter
	m.reset(base)
	event := func(o dialect.Obs) {
		at := base.Add(time.Duration(got.Events) * time.Millisecond)
		m.observe(o, at)
		m.wrote(at)
		got.Events++
	}
	streamed := want.Framing != "body"
	switch want.Framing {
	case "sse":
		p := sse.NewParser(1 << 20)
		for _, b := range pieces {
			p.Feed(b)
			for p.Next() {
				ev := p.Event()
				event(d.Event(ev.Type, ev.Data))
			}
		}
	case "ndjson":
		l := sse.NewLines(1 << 20)
		for _, b := range pieces {
			l.Feed(b)
			for l.Next() {
				event(d.Event(nil, l.Line()))
			}
		}
	case "body":
		var body []byte
		for _, b := range pieces {
			body = append(body, b...)
		}
		o := d.Body(body)
		o.Token, o.Answer = false, false // as the relay does for bodies
		m.observe(o, base)
	}
	var rec metrics.Record
	rec.Reset()
	m.fill(&rec, base, streamed)
	m.finish(&rec, streamed)
	got.TokenEvents, got.AnswerEvents, got.Items, got.Error = m.events, m.answers, rec.Items, m.streamError
	index := func(d time.Duration) *int {
		i := int(d / time.Millisecond)
		if d < 0 {
			i = -1
		}
		return &i
	}
	if streamed {
		got.FirstTokenEvent, got.FirstAnswerEvent = index(rec.TTFT), index(rec.TTFA)
	}
	if m.usage.hasIn {
		got.InputTokens = &m.usage.in
	}
	if m.usage.hasOut {
		got.OutputTokens = &m.usage.out
	}
	msp := func(d time.Duration) *float64 {
		if d < 0 {
			return nil
		}
		f := float64(d.Microseconds()) / 1000
		return &f
	}
	if m.timings.Set {
		got.ServerQueueMs, got.ServerLoadMs, got.ServerPrefillMs, got.ServerDecodeMs, got.ServerTTFTMs =
			msp(rec.ServerQueue), msp(rec.ServerLoad), msp(rec.ServerPrefill), msp(rec.ServerDecode), msp(rec.ServerTTFT)
	}
	return got
}

// Every dialect fixture, measured by the meter the relay uses, whole and
// one byte per read.
func TestDialectFixturesThroughTheMeter(t *testing.T) {
	dir := filepath.Join("..", "..", "sse", "dialect", "testdata")
	wants, _ := filepath.Glob(filepath.Join(dir, "*.want.json"))
	if len(wants) < 20 {
		t.Fatalf("only %d fixtures", len(wants))
	}
	seen := map[string]bool{}
	for _, wf := range wants {
		name := strings.TrimSuffix(filepath.Base(wf), ".want.json")
		t.Run(name, func(t *testing.T) {
			raw, err := os.ReadFile(wf)
			if err != nil {
				t.Fatal(err)
			}
			var want fixture
			dec := json.NewDecoder(strings.NewReader(string(raw)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&want); err != nil {
				t.Fatalf("%s: %v", wf, err)
			}
			if want.Framing != "body" && want.FirstTokenEvent == nil {
				want.FirstTokenEvent, want.FirstAnswerEvent = intp(-1), intp(-1)
			}
			if want.Framing != "body" && want.FirstAnswerEvent == nil {
				want.FirstAnswerEvent = intp(-1)
			}
			var data []byte
			for _, f := range []string{name + ".sse", name + ".ndjson", name} {
				if data, err = os.ReadFile(filepath.Join(dir, f)); err == nil {
					break
				}
			}
			if err != nil {
				t.Fatalf("no data file for fixture %s", name)
			}
			seen[want.Dialect] = true
			check := func(how string, pieces [][]byte) {
				got := replayFixture(want, pieces)
				if !reflect.DeepEqual(got, want) {
					g, _ := json.Marshal(got)
					w, _ := json.Marshal(want)
					t.Errorf("%s (%s):\n got %s\nwant %s", name, how, g, w)
				}
			}
			check("whole", [][]byte{data})
			one := make([][]byte, len(data))
			for i := range data {
				one[i] = data[i : i+1]
			}
			check("one byte per read", one)
		})
	}
	for _, d := range dialect.All {
		if d != dialect.Generic && !seen[d.Name()] {
			t.Errorf("no fixture for dialect %s", d.Name())
		}
	}
}

func intp(i int) *int { return &i }
