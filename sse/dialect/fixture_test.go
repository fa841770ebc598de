package dialect

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/sse"
)

// summary is what a recorded response says, as the proxy would merge it:
// the expected half of each testdata fixture (NAME.want.json beside NAME.sse,
// NAME.ndjson or NAME.json).
type summary struct {
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
}

func intp(i int) *int { return &i }

func msp(d time.Duration) *float64 {
	if d < 0 {
		return nil
	}
	f := float64(d.Microseconds()) / 1000
	return &f
}

// merge folds one observation into s the way the proxy does.
func (s *summary) merge(o Obs, index int) {
	if o.Token {
		s.TokenEvents++
		if s.FirstTokenEvent == nil || *s.FirstTokenEvent < 0 {
			s.FirstTokenEvent = intp(index)
		}
		if o.Answer {
			s.AnswerEvents++
			if s.FirstAnswerEvent == nil || *s.FirstAnswerEvent < 0 {
				s.FirstAnswerEvent = intp(index)
			}
		}
	}
	if o.HasIn {
		s.InputTokens = intp(o.In)
	}
	if o.HasOut {
		s.OutputTokens = intp(o.Out)
	}
	if o.Items > 0 {
		s.Items = o.Items
	}
	s.Error = s.Error || o.Error
	if t := o.Timings; t.Set {
		s.ServerQueueMs, s.ServerLoadMs, s.ServerPrefillMs, s.ServerDecodeMs = msp(t.Queue), msp(t.Load), msp(t.Prefill), msp(t.Decode)
	}
}

// replay runs a recorded response through the framing and the dialect,
// fed in the given pieces.
func replay(t *testing.T, want summary, pieces [][]byte) summary {
	t.Helper()
	d := ForPath([]byte(want.Path))
	got := summary{Path: want.Path, Framing: want.Framing, Dialect: d.Name()}
	switch want.Framing {
	case "sse":
		got.FirstTokenEvent, got.FirstAnswerEvent = intp(-1), intp(-1)
		p := sse.NewParser(1 << 20)
		for _, b := range pieces {
			p.Feed(b)
			for p.Next() {
				ev := p.Event()
				got.merge(d.Event(ev.Type, ev.Data), got.Events)
				got.Events++
			}
		}
	case "ndjson":
		got.FirstTokenEvent, got.FirstAnswerEvent = intp(-1), intp(-1)
		l := sse.NewLines(1 << 20)
		for _, b := range pieces {
			l.Feed(b)
			for l.Next() {
				got.merge(d.Event(nil, l.Line()), got.Events)
				got.Events++
			}
		}
	case "body":
		var body []byte
		for _, b := range pieces {
			body = append(body, b...)
		}
		o := d.Body(body)
		o.Token, o.Answer = false, false
		got.merge(o, 0)
	default:
		t.Fatalf("unknown framing %q", want.Framing)
	}
	return got
}

func TestFixtures(t *testing.T) {
	wants, _ := filepath.Glob("testdata/*.want.json")
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
			var want summary
			dec := json.NewDecoder(strings.NewReader(string(raw)))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&want); err != nil {
				t.Fatalf("%s: %v", wf, err)
			}
			data := fixtureData(t, name)
			seen[want.Dialect] = true
			check := func(how string, pieces [][]byte) {
				got := replay(t, want, pieces)
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
	for _, d := range All {
		if d != Generic && !seen[d.Name()] {
			t.Errorf("no fixture for dialect %s", d.Name())
		}
	}
}

// fixtureData finds NAME.sse, NAME.ndjson or NAME (a .json body).
func fixtureData(t *testing.T, name string) []byte {
	for _, f := range []string{name + ".sse", name + ".ndjson", name} {
		if b, err := os.ReadFile(filepath.Join("testdata", f)); err == nil {
			return b
		}
	}
	t.Fatalf("no data file for fixture %s", name)
	return nil
}
