package measure

import "github.com/tokentap/tokentap/proxy/internal/conf"

// Classes sorts requests into classes by what tokentap reads of them, so
// that two upstreams are compared like with like: a canary that happened
// to get more long prompts is slower to its first token without being
// slower. A class is the request's input size, its output size and, where
// the backend reports cached input tokens, whether its prefix was reused:
// the axes of an upgrade matrix (short chat, a long document with a short
// answer, a long output; a fresh or a reused prefix).
type Classes struct {
	// InputTokens: short below the first, long from the second, medium
	// between (default 1,024 and 4,096).
	InputTokens [2]int
	// OutputTokens: short below it, long from it (default 512).
	OutputTokens int
}

// The classes' default thresholds.
const (
	defaultClassInputShort  = 1024
	defaultClassInputLong   = 4096
	defaultClassOutputShort = 512
)

// WithDefaults returns c with its zero thresholds set to their defaults.
func (c Classes) WithDefaults() Classes {
	if c.InputTokens == [2]int{} {
		c.InputTokens = [2]int{defaultClassInputShort, defaultClassInputLong}
	}
	if c.OutputTokens == 0 {
		c.OutputTokens = defaultClassOutputShort
	}
	return c
}

// Validate checks the thresholds of c (zero ones take their defaults).
func (c Classes) Validate() error {
	switch in := c.InputTokens; {
	case in[0] < 0 || in[1] < 0:
		return conf.Errf("classes.input_tokens", "must not be negative")
	case in != [2]int{} && (in[0] == 0 || in[1] < in[0]):
		return conf.Errf("classes.input_tokens", "two thresholds, the second at least the first")
	case c.OutputTokens < 0:
		return conf.Errf("classes.output_tokens", "must not be negative")
	}
	return nil
}

// classNames holds every class name, by input size, output size and
// prefix (unknown, fresh, reused): naming a request's class allocates
// nothing.
var classNames = func() (n [3][2][3]string) {
	for i, in := range []string{"in-short", "in-medium", "in-long"} {
		for o, out := range []string{"out-short", "out-long"} {
			for p, prefix := range []string{"", ".prefix-fresh", ".prefix-reused"} {
				n[i][o][p] = in + "." + out + prefix
			}
		}
	}
	return n
}()

// ValidClass reports whether name is a class's name.
func ValidClass(name string) bool {
	for _, byIn := range classNames {
		for _, byOut := range byIn {
			for _, n := range byOut {
				if n == name {
					return true
				}
			}
		}
	}
	return false
}

// Of names the class of a request with in input tokens, out output tokens
// and cached input tokens served from the backend's prompt cache (-1: not
// reported), under thresholds c (with their defaults).
func (c Classes) Of(in, out, cached int) string {
	i := 0
	switch {
	case in >= c.InputTokens[1]:
		i = 2
	case in >= c.InputTokens[0]:
		i = 1
	}
	o := 0
	if out >= c.OutputTokens {
		o = 1
	}
	p := 0
	switch {
	case cached > 0:
		p = 2
	case cached == 0:
		p = 1
	}
	return classNames[i][o][p]
}
