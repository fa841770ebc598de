package sse

import (
	"fmt"
	"strings"
	"testing"
)

func splitLines(l *Lines, pieces ...[]byte) []string {
	var out []string
	for _, b := range pieces {
		l.Feed(b)
		for l.Next() {
			s := string(l.Line())
			if l.Truncated() {
				s += "…"
			}
			out = append(out, s)
		}
	}
	return out
}

func TestLines(t *testing.T) {
	f := func(in string, want ...string) {
		t.Helper()
		check := func(how string, pieces [][]byte) {
			t.Helper()
			if res := splitLines(NewLines(16), pieces...); fmt.Sprint(res) != fmt.Sprint(want) {
				t.Errorf("%q (%s): got %q want %q", in, how, res, want)
			}
		}
		check("whole", [][]byte{[]byte(in)})
		check("one byte per read", byteByByte(in))
		for i := 1; i < len(in); i++ {
			check(fmt.Sprintf("split at %d", i), [][]byte{[]byte(in[:i]), []byte(in[i:])})
		}
	}
	f("{\"a\":1}\n{\"b\":2}\n", `{"a":1}`, `{"b":2}`)
	f("{\"a\":1}\r\n\r\n\n{\"b\":2}\r\n", `{"a":1}`, `{"b":2}`)
	f("{\"a\":1}\n{\"b\":", `{"a":1}`)
	f("{\"x\":\"é✓\"}\n", `{"x":"é✓"}`)
	f(strings.Repeat("x", 20)+"\nok\n", strings.Repeat("x", 16)+"…", "ok")
}

func TestLinesPendingAndNoAllocs(t *testing.T) {
	l := NewLines(0)
	if splitLines(l, []byte("a\nb")); !l.Pending() || l.Count() != 1 {
		t.Fatalf("pending=%v count=%d", l.Pending(), l.Count())
	}
	chunk := []byte("{\"message\":{\"content\":\"hi\"},\"done\":false}\n{\"done\":true}\n")
	run := func() {
		l.Feed(chunk[:10])
		for l.Next() {
		}
		l.Feed(chunk[10:])
		for l.Next() {
		}
	}
	run()
	if a := testing.AllocsPerRun(100, run); a != 0 {
		t.Fatalf("allocs per run = %v, want 0", a)
	}
}

func FuzzLinesSplits(f *testing.F) {
	f.Add("{\"a\":1}\n{\"b\":2}\r\n", uint16(3))
	f.Fuzz(func(t *testing.T, in string, at uint16) {
		if len(in) > 4096 {
			return
		}
		whole := splitLines(NewLines(1<<20), []byte(in))
		i := int(at) % (len(in) + 1)
		if split := splitLines(NewLines(1<<20), []byte(in[:i]), []byte(in[i:])); fmt.Sprint(split) != fmt.Sprint(whole) {
			t.Fatalf("split at %d of %q: got %q want %q", i, in, split, whole)
		}
		if bb := splitLines(NewLines(1<<20), byteByByte(in)...); fmt.Sprint(bb) != fmt.Sprint(whole) {
			t.Fatalf("byte by byte of %q: got %q want %q", in, bb, whole)
		}
	})
}
