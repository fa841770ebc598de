package dialect

import (
	"bytes"

	"github.com/tidwall/gjson"
)

// InjectIncludeUsage returns an OpenAI streaming request body with
// stream_options.include_usage set to true, appended to dst, and true; or
// dst unchanged and false when the body already asks for usage or is not a
// JSON object. Every other byte of the body is kept as it was.
func InjectIncludeUsage(dst, body []byte) ([]byte, bool) {
	s := object(body)
	if s == "" || !gjson.ValidBytes(body) {
		return dst, false
	}
	// body may have leading space: object() trimmed it, offsets are into s.
	lead := bytes.Index(body, []byte(s[:1]))
	so := gjson.Get(s, "stream_options")
	var at int
	var insert string
	switch {
	case !so.Exists():
		at, insert = lead+1, `"stream_options":{"include_usage":true}`
		if !emptyAfter(body[at:]) {
			insert += ","
		}
	case so.IsObject():
		iu := gjson.Get(so.Raw, "include_usage")
		if iu.Type == gjson.True {
			return dst, false
		}
		if iu.Exists() {
			// Replace the value in place.
			start := lead + so.Index + iu.Index
			dst = append(dst, body[:start]...)
			dst = append(dst, "true"...)
			return append(dst, body[start+len(iu.Raw):]...), true
		}
		at, insert = lead+so.Index+1, `"include_usage":true`
		if !emptyAfter(body[at:]) {
			insert += ","
		}
	default:
		// null or not an object: replace it.
		start := lead + so.Index
		dst = append(dst, body[:start]...)
		dst = append(dst, `{"include_usage":true}`...)
		return append(dst, body[start+len(so.Raw):]...), true
	}
	dst = append(dst, body[:at]...)
	dst = append(dst, insert...)
	return append(dst, body[at:]...), true
}

// emptyAfter reports whether b, after an opening brace, starts with the
// closing brace (an empty object).
func emptyAfter(b []byte) bool {
	b = bytes.TrimLeft(b, " \t\r\n")
	return len(b) > 0 && b[0] == '}'
}

// UsageOnly reports an OpenAI chunk that carries usage and no choices: the
// chunk stream_options.include_usage adds at the end of a stream.
func UsageOnly(data []byte) bool {
	s := object(data)
	if s == "" || !gjson.Get(s, "usage").IsObject() {
		return false
	}
	c := gjson.Get(s, "choices")
	return !c.Exists() || (c.IsArray() && !nonEmptyArray(c))
}
