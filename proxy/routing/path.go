package routing

import (
	"bytes"
	"errors"
	"strings"

	"github.com/tokentap/tokentap/proxy/internal/conf"
)

// errBadPath is a request path that cannot be normalised safely.
var errBadPath = errors.New("invalid request path")

// NormalizePath appends to dst the normal form of an origin-form request
// path (no query), the form routes are matched on and the upstream
// receives:
//
//   - percent-encoded unreserved characters (RFC 3986 §2.3: letters,
//     digits, "-", ".", "_", "~") are decoded, so /%76%31/ is /v1/; other
//     escapes are kept, their hex digits in upper case (§6.2.2.1);
//   - runs of slashes become one, as nginx's merge_slashes does;
//   - "." and ".." segments are removed (§5.2.4).
//
// It refuses, rather than guess what an upstream would make of them:
// escaped slashes and backslashes (%2F, %5C: a later decoding would turn
// ..%2f into a dot segment), NUL, raw backslashes, control characters and
// spaces, malformed escapes, and ".." climbing above the root.
func NormalizePath(dst, path []byte) ([]byte, error) {
	if len(path) == 0 || path[0] != '/' {
		return dst, errBadPath
	}
	start := len(dst)
	// seg collects one segment, decoded; segments are appended to dst as
	// they end, dot segments resolved against what dst holds.
	var segBuf [64]byte
	seg := segBuf[:0]
	var err error
	for i := 1; i < len(path); i++ {
		c := path[i]
		switch {
		case c == '/':
			if dst, err = endSegment(dst, start, seg, false); err != nil {
				return dst[:start], err
			}
			seg = seg[:0]
		case c == '%':
			if i+2 >= len(path) {
				return dst[:start], errBadPath
			}
			hi, lo := unhex(path[i+1]), unhex(path[i+2])
			if hi < 0 || lo < 0 {
				return dst[:start], errBadPath
			}
			d := byte(hi<<4 | lo)
			switch {
			case unreserved(d):
				seg = append(seg, d)
			case d == '/' || d == '\\' || d == 0:
				return dst[:start], errBadPath
			default:
				seg = append(seg, '%', upperHex[d>>4], upperHex[d&15])
			}
			i += 2
		case c <= ' ' || c == 0x7f || c == '\\':
			return dst[:start], errBadPath
		default:
			seg = append(seg, c)
		}
	}
	if dst, err = endSegment(dst, start, seg, true); err != nil {
		return dst[:start], err
	}
	if len(dst) == start {
		dst = append(dst, '/')
	}
	return dst, nil
}

// endSegment appends the segment seg, just ended (last: by the path's
// end), to the path built in dst from start: a dot segment is resolved
// against what dst holds, an empty one (a repeated slash, or the trailing
// one) adds nothing but a trailing slash.
func endSegment(dst []byte, start int, seg []byte, last bool) ([]byte, error) {
	switch {
	case len(seg) == 0:
		if last && len(dst) > start && dst[len(dst)-1] != '/' {
			dst = append(dst, '/')
		}
	case string(seg) == ".":
		if len(dst) == start || dst[len(dst)-1] != '/' {
			dst = append(dst, '/')
		}
	case string(seg) == "..":
		// Drop the last segment of dst, keeping its leading slash.
		if len(dst) == start {
			return dst, errBadPath
		}
		if dst[len(dst)-1] == '/' {
			dst = dst[:len(dst)-1]
		}
		i := bytes.LastIndexByte(dst[start:], '/')
		if i < 0 {
			return dst, errBadPath
		}
		dst = dst[:start+i+1]
	default:
		if len(dst) == start || dst[len(dst)-1] != '/' {
			dst = append(dst, '/')
		}
		dst = append(dst, seg...)
	}
	return dst, nil
}

const upperHex = "0123456789ABCDEF"

func unhex(c byte) int {
	switch {
	case '0' <= c && c <= '9':
		return int(c - '0')
	case 'a' <= c && c <= 'f':
		return int(c - 'a' + 10)
	case 'A' <= c && c <= 'F':
		return int(c - 'A' + 10)
	}
	return -1
}

func unreserved(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~'
}

// PrefixMatch reports whether a normalised path falls under a route prefix,
// on segment boundaries: /ollama matches /ollama and /ollama/api, never
// /ollamaEVIL; a prefix ending in a slash matches what starts with it.
func PrefixMatch(path []byte, prefix string) bool {
	if !bytes.HasPrefix(path, []byte(prefix)) {
		return false
	}
	return len(path) == len(prefix) || prefix[len(prefix)-1] == '/' || path[len(prefix)] == '/'
}

// Serves reports whether a route of models (globs) takes requests for
// model: one without models takes every model.
func Serves(models []string, model string) bool {
	if len(models) == 0 {
		return true
	}
	for _, g := range models {
		if conf.Glob(g, model) {
			return true
		}
	}
	return false
}

// LiteralModels returns the globs of models that are plain names (no * or
// ?): each its own metric label on its route.
func LiteralModels(models []string) []string {
	var out []string
	for _, g := range models {
		if !strings.ContainsAny(g, "*?") {
			out = append(out, g)
		}
	}
	return out
}
