// Package conf holds what every concern of the relay uses to check its
// section of the configuration: the error that names the field at fault
// (FieldError), the globs models are named by (Glob), and HTTP tokens
// (IsToken). It imports nothing of the relay.
package conf

import (
	"errors"
	"fmt"
	"os"
	"strings"
)

// FieldError is a configuration error: the field at fault, as the path of
// its key in tokentap's config file (routes[2].prefix), and what is wrong.
type FieldError struct{ Path, Msg string }

func (e *FieldError) Error() string { return e.Path + ": " + e.Msg }

// Field returns the path of the field at fault.
func (e *FieldError) Field() string { return e.Path }

// Errf returns a *FieldError for the field at path.
func Errf(path, format string, args ...any) error {
	return &FieldError{Path: path, Msg: fmt.Sprintf(format, args...)}
}

// Glob reports whether name matches pattern, where * matches any run of
// bytes (slashes included: model names hold them) and ? any one byte.
func Glob(pattern, name string) bool {
	p, n := 0, 0
	star, mark := -1, 0
	for n < len(name) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			star, mark = p, n
			p++
		case p < len(pattern) && (pattern[p] == '?' || pattern[p] == name[n]):
			p++
			n++
		case star >= 0:
			p, mark = star+1, mark+1
			n = mark
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// tchar marks the characters of an RFC 9110 token.
var tchar = func() (t [256]bool) {
	for c := 0; c < 256; c++ {
		t[c] = 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", byte(c)) >= 0
	}
	return t
}()

// TokenChar reports whether c may appear in an RFC 9110 token.
func TokenChar(c byte) bool { return tchar[c] }

// IsToken reports whether s is a non-empty RFC 9110 token (a header
// name).
func IsToken(s string) bool {
	for i := 0; i < len(s); i++ {
		if !tchar[s[i]] {
			return false
		}
	}
	return s != ""
}

// DescribeFileError keeps the file error's kind and drops any bytes of
// the files it may quote.
func DescribeFileError(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Error()
	}
	return "not a PEM certificate and its private key"
}
