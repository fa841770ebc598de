package proxy

import (
	"strings"
	"testing"
)

func TestNormalizePath(t *testing.T) {
	f := func(in, want string) {
		t.Helper()
		got, err := normalizePath(nil, []byte(in))
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
		if got := prefixMatch([]byte(tc.path), tc.prefix); got != tc.want {
			t.Errorf("prefixMatch(%q, %q) = %v", tc.path, tc.prefix, got)
		}
	}
}

func FuzzNormalizePath(f *testing.F) {
	for _, s := range []string{"/", "/a/../b", "//x//y/", "/%2e%2e/", "/%41%2f", "/a/./b/../../c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		out, err := normalizePath(nil, []byte(in))
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
		again, err := normalizePath(nil, out)
		if err != nil || string(again) != s {
			t.Fatalf("not idempotent: %q → %q → %q (%v)", in, s, again, err)
		}
	})
}

func TestConfigRefusesWhatWouldPanicOrNeverMatch(t *testing.T) {
	base := func() Config {
		return Config{Routes: []Route{{Name: "r", Prefix: "/", Upstream: "http://127.0.0.1:1", Timeouts: DefaultTimeouts}}}
	}
	for name, edit := range map[string]func(*Config){
		"model other":        func(c *Config) { c.Models = []string{"other"} },
		"model duplicate":    func(c *Config) { c.Models = []string{"a", "a"} },
		"model empty":        func(c *Config) { c.Models = []string{""} },
		"prefix dot":         func(c *Config) { c.Routes[0].Prefix = "/a/../b" },
		"prefix slashes":     func(c *Config) { c.Routes[0].Prefix = "//v1/" },
		"prefix escaped v1":  func(c *Config) { c.Routes[0].Prefix = "/%76%31/" },
		"zero first byte":    func(c *Config) { c.Routes[0].Timeouts.FirstByte = 0 },
		"negative max conns": func(c *Config) { c.Routes[0].Timeouts.MaxConns = -1 },
		"enforce, no models": func(c *Config) { c.EnforceModels = true },
	} {
		c := base()
		edit(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted it", name)
		}
		if _, err := New(c, Options{}); err == nil {
			t.Errorf("%s: New accepted it", name)
		}
	}
}
