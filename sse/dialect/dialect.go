// Package dialect reads the payloads of LLM API streams and bodies: which
// events carry tokens, where usage and errors are. It sits on top of the
// framing in package sse and extracts fields with gjson, never decoding a
// whole JSON document.
//
// A Dialect is chosen per request from its path (ForPath). Its methods are
// pure functions of their input, safe for concurrent use, and do not keep
// references to the bytes they are given.
//
//	d := dialect.ForPath(path)
//	obs := d.Event(ev.Type, ev.Data)
//	if obs.Token { ... }
package dialect

import (
	"bytes"
	"unsafe"

	"github.com/tidwall/gjson"
)

// Obs is what one event, line or body says about the response.
type Obs struct {
	// Token reports a token event: the event carries generated output of
	// any kind (text, reasoning or a tool call).
	Token bool
	// Answer reports that the output is visible answer text or a tool call,
	// as opposed to reasoning only.
	Answer bool
	// Usage reports that the event carried token usage, given in
	// InputTokens and OutputTokens.
	Usage        bool
	InputTokens  int
	OutputTokens int
	// Error reports an error object inside the stream or body.
	Error bool
}

// Dialect reads one API's events and bodies.
type Dialect interface {
	// Name is the dialect's name as it appears in records and docs.
	Name() string
	// Event reads one SSE event (its type and data) or NDJSON line (typ nil).
	Event(typ, data []byte) Obs
	// Body reads a complete non-streamed response body.
	Body(body []byte) Obs
}

// ForPath picks the dialect for a request path (without the query).
// Unknown paths get Generic, which still measures the stream.
func ForPath(path []byte) Dialect {
	switch {
	case bytes.HasSuffix(path, []byte("/chat/completions")), bytes.HasSuffix(path, []byte("/completions")):
		return OpenAI
	}
	return Generic
}

// Request is what the request body says about the call.
type Request struct {
	// Model is the "model" field, aliasing the body.
	Model []byte
	// Stream is the "stream" field.
	Stream bool
}

// ReadRequest extracts the model and stream flag from an OpenAI-style JSON
// request body. Model aliases body.
func ReadRequest(body []byte) Request {
	s := str(body)
	res := gjson.GetMany(s, "model", "stream")
	var r Request
	if m := res[0]; m.Type == gjson.String && m.Index > 0 && !hasEscape(m.Raw) {
		// The value without quotes, as a view into body.
		r.Model = body[m.Index+1 : m.Index+len(m.Raw)-1]
	} else if m.Type == gjson.String {
		r.Model = []byte(m.Str)
	}
	r.Stream = res[1].Bool()
	return r
}

func hasEscape(raw string) bool {
	for i := 0; i < len(raw); i++ {
		if raw[i] == '\\' {
			return true
		}
	}
	return false
}

// str views b as a string without copying. The string must not outlive b's
// contents, which is why no gjson result leaves this package.
func str(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

var done = []byte("[DONE]")

// genericDialect counts every event or line as a token event.
type genericDialect struct{}

// Generic measures any stream: each SSE event or NDJSON line (except a
// literal [DONE]) is a token event, and output tokens are counted.
var Generic Dialect = genericDialect{}

func (genericDialect) Name() string { return "generic" }

func (genericDialect) Event(_, data []byte) Obs {
	if bytes.Equal(data, done) {
		return Obs{}
	}
	return Obs{Token: true, Answer: true}
}

func (genericDialect) Body([]byte) Obs { return Obs{} }
