package proxy

import (
	"testing"
)

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
