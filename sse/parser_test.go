package sse

import (
	"fmt"
	"strings"
	"testing"
)

// got is an event as the tests compare it.
type got struct {
	Type, Data, ID string
	Retry          int
	Truncated      bool
}

func (g got) String() string {
	return fmt.Sprintf("{type=%q data=%q id=%q retry=%d trunc=%v}", g.Type, g.Data, g.ID, g.Retry, g.Truncated)
}

// parseSplit feeds the pieces one at a time and collects every event.
func parseSplit(p *Parser, pieces ...[]byte) []got {
	var out []got
	for _, b := range pieces {
		p.Feed(b)
		for p.Next() {
			ev := p.Event()
			out = append(out, got{string(ev.Type), string(ev.Data), string(ev.ID), ev.Retry, ev.Truncated})
		}
	}
	return out
}

// byteByByte splits s into one-byte pieces.
func byteByByte(s string) [][]byte {
	out := make([][]byte, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = []byte{s[i]}
	}
	return out
}

// reference is a deliberately naive, allocation-heavy reading of the spec,
// used to check Parser differentially. It works on the whole stream at once.
func reference(s string, max int) []got {
	s = strings.TrimPrefix(s, "\ufeff")
	var lines []string
	for len(s) > 0 {
		i := strings.IndexAny(s, "\r\n")
		if i < 0 {
			break // an unterminated last line is never processed
		}
		lines = append(lines, s[:i])
		if s[i] == '\r' && i+1 < len(s) && s[i+1] == '\n' {
			i++
		}
		s = s[i+1:]
	}
	var out []got
	var data, typ, id strings.Builder
	hasData, retry := false, -1
	for _, line := range lines {
		if line == "" {
			if hasData {
				d := data.String()
				d = d[:len(d)-1]
				out = append(out, got{typ.String(), d, id.String(), retry, false})
			}
			data.Reset()
			typ.Reset()
			hasData, retry = false, -1
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "data":
			data.WriteString(value + "\n")
			hasData = true
		case "event":
			typ.Reset()
			typ.WriteString(value)
		case "id":
			if !strings.Contains(value, "\x00") {
				id.Reset()
				id.WriteString(value)
			}
		case "retry":
			if n, ok := parseDigits([]byte(value)); ok {
				retry = n
			}
		}
	}
	return out
}

func TestParser(t *testing.T) {
	f := func(name, in string, want ...got) {
		t.Helper()
		check := func(how string, pieces [][]byte) {
			t.Helper()
			res := parseSplit(NewParser(64), pieces...)
			if fmt.Sprint(res) != fmt.Sprint(want) {
				t.Errorf("%s (%s):\n got %v\nwant %v", name, how, res, want)
			}
		}
		check("whole", [][]byte{[]byte(in)})
		check("one byte per read", byteByByte(in))
		for i := 1; i < len(in); i++ {
			check(fmt.Sprintf("split at %d", i), [][]byte{[]byte(in[:i]), []byte(in[i:])})
		}
	}
	ev := func(data string) got { return got{Data: data, Retry: -1} }

	f("lf", "data: a\n\ndata: b\n\n", ev("a"), ev("b"))
	f("crlf", "data: a\r\n\r\ndata: b\r\n\r\n", ev("a"), ev("b"))
	f("cr", "data: a\r\rdata: b\r\r", ev("a"), ev("b"))
	f("mixed line ends", "data: a\r\n\ndata: b\r\r\ndata: c\n\r", ev("a"), got{Data: "b", Retry: -1}, ev("c"))
	f("no space after colon", "data:a\n\n", ev("a"))
	f("only one space removed", "data:  a\n\n", ev(" a"))
	f("multi-line data", "data: a\ndata: b\ndata:\n\n", ev("a\nb\n"))
	f("empty data dispatches", "data\n\n", ev(""))
	f("comment and keep-alive", ": ping\n\n:\ndata: x\n\n", ev("x"))
	f("no data no dispatch", "event: foo\n\ndata: x\n\n", ev("x"))
	f("event type", "event: delta\ndata: x\n\n", got{Type: "delta", Data: "x", Retry: -1})
	f("type resets per event", "event: a\ndata: 1\n\ndata: 2\n\n", got{Type: "a", Data: "1", Retry: -1}, ev("2"))
	f("id persists", "id: 7\ndata: a\n\ndata: b\n\n", got{Data: "a", ID: "7", Retry: -1}, got{Data: "b", ID: "7", Retry: -1})
	f("id with NUL ignored", "id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n", got{Data: "a", ID: "1", Retry: -1}, got{Data: "b", ID: "1", Retry: -1})
	f("retry", "retry: 1500\ndata: a\n\nretry: 1x\ndata: b\n\n", got{Data: "a", Retry: 1500}, ev("b"))
	f("unknown field ignored", "foo: bar\ndata: a\n\n", ev("a"))
	f("field without colon", "data\ndata\n\n", ev("\n"))
	f("bom stripped once", "\ufeffdata: a\n\n", ev("a"))
	f("second bom is a field name", "\ufeff\ufeffdata: a\n\n")
	f("bom prefix that is not a bom", "\xef\xbbdata: a\n\ndata: b\n\n", ev("b"))
	f("unterminated last event discarded", "data: a\n\ndata: b\n", ev("a"))
	f("unterminated last line discarded", "data: a\n\ndata: b", ev("a"))
	f("utf-8 split anywhere", "data: héllo ✓ 🙂\n\n", ev("héllo ✓ 🙂"))
	f("openai done", "data: {\"x\":1}\n\ndata: [DONE]\n\n", ev(`{"x":1}`), ev("[DONE]"))
	f("truncated at max", "data: "+strings.Repeat("x", 100)+"\n\ndata: ok\n\n",
		got{Data: strings.Repeat("x", 64), Retry: -1, Truncated: true}, ev("ok"))
	f("truncated across lines", "data: "+strings.Repeat("y", 40)+"\ndata: "+strings.Repeat("z", 40)+"\n\n",
		got{Data: strings.Repeat("y", 40) + "\n" + strings.Repeat("z", 23), Retry: -1, Truncated: true})
}

func TestParserReferenceAgreement(t *testing.T) {
	inputs := []string{
		"data: a\r\n\r\n",
		"event: x\rdata: 1\rdata: 2\r\r: c\r\n\r\n",
		"id: 1\nretry: 10\ndata: z\n\nid\ndata: q\n\n",
		"\ufeffdata: a\n\n",
	}
	for _, in := range inputs {
		want := reference(in, 1<<20)
		res := parseSplit(NewParser(1<<20), byteByByte(in)...)
		if fmt.Sprint(res) != fmt.Sprint(want) {
			t.Errorf("%q:\n got %v\nwant %v", in, res, want)
		}
	}
}

func TestParserPendingAndCounts(t *testing.T) {
	p := NewParser(0)
	n := len(parseSplit(p, []byte(": keep-alive\n\ndata: a\n\ndata: b")))
	if n != 1 || p.Events() != 1 || p.Comments() != 1 || !p.Pending() {
		t.Fatalf("events=%d/%d comments=%d pending=%v", n, p.Events(), p.Comments(), p.Pending())
	}
	p.Reset()
	if parseSplit(p, []byte("data: c\n\n")); p.Pending() || p.Events() != 1 {
		t.Fatalf("after reset: pending=%v events=%d", p.Pending(), p.Events())
	}
}

func TestParserNoAllocsSteadyState(t *testing.T) {
	p := NewParser(1 << 16)
	chunk := []byte("data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n: ping\n\nevent: e\ndata: a\ndata: b\n\n")
	half := len(chunk) / 3
	run := func() {
		p.Feed(chunk[:half])
		for p.Next() {
		}
		p.Feed(chunk[half:])
		for p.Next() {
		}
	}
	run()
	if a := testing.AllocsPerRun(100, run); a != 0 {
		t.Fatalf("allocs per run = %v, want 0", a)
	}
}

// FuzzParserSplits checks that any split of an input yields the same events
// as the whole input, and that the parser agrees with the naive reference.
func FuzzParserSplits(f *testing.F) {
	for _, s := range []string{"data: a\n\n", "data: a\r\n\r\n", "event: x\rdata: 1\r\r", "\ufeffdata:b\n\n", "id: 1\nretry: 5\ndata\n\n"} {
		f.Add(s, uint16(1), uint16(3))
	}
	f.Fuzz(func(t *testing.T, in string, a, b uint16) {
		if len(in) > 4096 {
			return
		}
		whole := parseSplit(NewParser(1<<20), []byte(in))
		if want := reference(in, 1<<20); fmt.Sprint(whole) != fmt.Sprint(want) {
			t.Fatalf("reference disagrees on %q:\n got %v\nwant %v", in, whole, want)
		}
		i, j := int(a)%(len(in)+1), int(b)%(len(in)+1)
		if i > j {
			i, j = j, i
		}
		split := parseSplit(NewParser(1<<20), []byte(in[:i]), []byte(in[i:j]), []byte(in[j:]))
		if fmt.Sprint(split) != fmt.Sprint(whole) {
			t.Fatalf("split %d/%d of %q:\n got %v\nwant %v", i, j, in, split, whole)
		}
		if bytes := parseSplit(NewParser(1<<20), byteByByte(in)...); fmt.Sprint(bytes) != fmt.Sprint(whole) {
			t.Fatalf("byte by byte of %q:\n got %v\nwant %v", in, bytes, whole)
		}
	})
}

func TestParserOffset(t *testing.T) {
	in := []byte(": c\n\ndata: a\r\n\r\ndata: bb\n\ndata: c")
	p := NewParser(0)
	p.Feed(in)
	var ends []int
	for p.Next() {
		ends = append(ends, p.Offset())
	}
	if want := []int{16, 26}; fmt.Sprint(ends) != fmt.Sprint(want) {
		t.Fatalf("event ends %v, want %v", ends, want)
	}
	if p.Offset() != len(in) || !p.Pending() {
		t.Fatalf("after input: offset %d pending %v", p.Offset(), p.Pending())
	}
}
