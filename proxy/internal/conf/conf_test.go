package conf

import (
	"regexp"
	"strings"
	"testing"
)

// globRegexp is Glob's meaning written as a regular expression: the
// oracle the matcher is checked against.
func globRegexp(pattern string) *regexp.Regexp {
	var b strings.Builder
	b.WriteString(`^(?s:`)
	for _, c := range pattern {
		switch c {
		case '*':
			b.WriteString(`.*`)
		case '?':
			b.WriteString(`.`)
		default:
			b.WriteString(regexp.QuoteMeta(string(c)))
		}
	}
	b.WriteString(`)$`)
	return regexp.MustCompile(b.String())
}

func TestGlobMatch(t *testing.T) {
	for _, c := range []struct {
		p, s string
		want bool
	}{
		{"llama-3-70b*", "llama-3-70b-instruct", true},
		{"llama-3-70b*", "llama-3-8b", false},
		{"*", "", true},
		{"meta-llama/*", "meta-llama/Llama-3-70B", true},
		{"*70b*", "meta-llama/llama-70b-chat", true},
		{"qwen-?b", "qwen-7b", true},
		{"qwen-?b", "qwen-14b", false},
		{"a*b*c", "aXbYbZc", true},
		{"a*b*c", "aXbYbZ", false},
		{"", "", true},
		{"", "x", false},
		{"*", "*0", true}, // a star in the name is no star in the pattern (found by FuzzGlobMatch)
		{"a*", "a*b", true},
	} {
		if got := Glob(c.p, c.s); got != c.want {
			t.Errorf("Glob(%q, %q) = %v, want %v", c.p, c.s, got, c.want)
		}
	}
}

// FuzzGlobMatch checks the matcher against its regular expression (ASCII
// and bytes alike: a model name is bytes).
func FuzzGlobMatch(f *testing.F) {
	f.Add("a*b?c", "aXXbYc")
	f.Add("**x", "yyx")
	f.Add("?*?", "ab")
	f.Fuzz(func(t *testing.T, pattern, name string) {
		if len(pattern) > 64 || len(name) > 256 {
			return
		}
		// ? is one byte and the oracle's . one rune: they agree on ASCII.
		for i := 0; i < len(pattern); i++ {
			if pattern[i] >= 0x80 {
				return
			}
		}
		for i := 0; i < len(name); i++ {
			if name[i] >= 0x80 {
				return
			}
		}
		if got, want := Glob(pattern, name), globRegexp(pattern).MatchString(name); got != want {
			t.Fatalf("Glob(%q, %q) = %v, the oracle says %v", pattern, name, got, want)
		}
	})
}

func TestIsToken(t *testing.T) {
	for s, want := range map[string]bool{"X-Priority": true, "": false, "a b": false, "a:b": false, "x\x7f": false, "!#$%&'*+-.^_`|~": true} {
		if IsToken(s) != want {
			t.Errorf("IsToken(%q) = %v, want %v", s, !want, want)
		}
	}
}
