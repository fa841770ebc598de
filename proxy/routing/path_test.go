package routing

import (
	"strings"
	"testing"
)

func TestNormalizePath(t *testing.T) {
	f := func(in, want string) {
		t.Helper()
		got, err := NormalizePath(nil, []byte(in))
		if want == "" {
			if err == nil {
				t.Errorf("%q: normalised to %q, want an error", in, got)
			}
			return
		}
		if err != nil || string(got) != want {
			t.Errorf("%q: got %q, %v; want %q", in, got, err, want)
		}
	}
	f("/", "/")
	f("/v1/chat/completions", "/v1/chat/completions")
	f("/v1/models/", "/v1/models/")
	f("//v1//chat///completions", "/v1/chat/completions")
	f("/%76%31/chat/completions", "/v1/chat/completions")
	f("/a/%7e%2D%2e%5F", "/a/~-._")
	f("/a/%c3%a9", "/a/%C3%A9")
	f("/a/%3a", "/a/%3A")
	f("/public/../private", "/private")
	f("/public/%2e%2e/private", "/private")
	f("/public/%2E%2e/private", "/private")
	f("/public/./x/.", "/public/x/")
	f("/a/b/..", "/a/")
	f("/a/..", "/")
	f("/a/b/../../c", "/c")
	f("/..a/b", "/..a/b")
	f("/a..", "/a..")
	f("/models/gemini-1.5-pro:streamGenerateContent", "/models/gemini-1.5-pro:streamGenerateContent")
	// Refused.
	f("/public/..%2fprivate", "")
	f("/public/..%2Fprivate", "")
	f("/a%5c..%5cb", "")
	f("/a\\b", "")
	f("/a%00b", "")
	f("/..", "")
	f("/a/../..", "")
	f("/%2e%2e/x", "")
	f("/a%", "")
	f("/a%4", "")
	f("/a%zz", "")
	f("/a b", "")
	f("/a\x01", "")
	f("a/b", "")
	f("", "")
	f("http://evil/x", "")
}

func TestPrefixMatch(t *testing.T) {
	for _, tc := range []struct {
		path, prefix string
		want         bool
	}{
		{"/ollama", "/ollama", true},
		{"/ollama/api/chat", "/ollama", true},
		{"/ollamaEVIL/api", "/ollama", false},
		{"/v1/chat", "/v1/", true},
		{"/v1", "/v1/", false},
		{"/anything", "/", true},
	} {
		if got := PrefixMatch([]byte(tc.path), tc.prefix); got != tc.want {
			t.Errorf("PrefixMatch(%q, %q) = %v", tc.path, tc.prefix, got)
		}
	}
}

func FuzzNormalizePath(f *testing.F) {
	for _, s := range []string{"/", "/a/../b", "//x//y/", "/%2e%2e/", "/%41%2f", "/a/./b/../../c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		out, err := NormalizePath(nil, []byte(in))
		if err != nil {
			return
		}
		s := string(out)
		if s[0] != '/' || strings.Contains(s, "//") || strings.Contains(s, "\\") {
			t.Fatalf("%q → %q", in, s)
		}
		for _, seg := range strings.Split(s, "/") {
			if seg == "." || seg == ".." {
				t.Fatalf("%q → %q keeps a dot segment", in, s)
			}
			if l := strings.ToLower(seg); strings.Contains(l, "%2f") || strings.Contains(l, "%5c") || strings.Contains(l, "%2e") {
				t.Fatalf("%q → %q keeps an escape it should have refused or decoded", in, s)
			}
		}
		again, err := NormalizePath(nil, out)
		if err != nil || string(again) != s {
			t.Fatalf("not idempotent: %q → %q → %q (%v)", in, s, again, err)
		}
	})
}
