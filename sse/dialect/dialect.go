// Package dialect reads the payloads of LLM API streams and bodies: which
// events carry tokens, which carry visible answer text, where usage, errors
// and server-side timings are. It sits on top of the framing in package sse
// and extracts fields with gjson, never decoding a whole JSON document.
//
// A Dialect is chosen per request from its path (ForPath) or by name from
// the config (ByName). Its methods are pure functions of their input, safe
// for concurrent use, and keep no reference to the bytes they are given
// (Request.Model aside, which aliases the request body).
//
//	d := dialect.ForPath(path)
//	req := d.Request(path, body)
//	obs := d.Event(ev.Type, ev.Data)
//	if obs.Token { ... }
package dialect

import (
	"bytes"
	"math"
	"strings"
	"time"
	"unsafe"

	"github.com/tidwall/gjson"
)

// Obs is what one event, line or body says about the response.
type Obs struct {
	// Token reports a token event: the event carries generated output of
	// any kind (text, reasoning or a tool call).
	Token bool
	// Answer reports visible answer text or a tool call, as opposed to
	// reasoning only. Answer implies Token.
	Answer bool
	// HasIn and HasOut report token usage given in In and Out. Some APIs
	// give them in different events (Anthropic: input at message_start,
	// output at message_delta); a later value replaces an earlier one.
	HasIn, HasOut bool
	In, Out       int
	// HasCached reports Cached: how many of the input tokens the backend
	// served from its prompt cache (a reused prefix), where it says.
	HasCached bool
	Cached    int
	// HasCacheWrite reports CacheWrite: how many of the input tokens the
	// backend wrote to its prompt cache (Anthropic's
	// cache_creation_input_tokens), priced apart by some providers.
	HasCacheWrite bool
	CacheWrite    int
	// HasReasoning reports Reasoning: how many of the output tokens were
	// reasoning (OpenAI's completion_tokens_details.reasoning_tokens and
	// output_tokens_details.reasoning_tokens, Gemini's thoughtsTokenCount).
	HasReasoning bool
	Reasoning    int
	// BadUsage reports a token count that cannot be true: negative, not
	// a whole number, not a number, or past maxCount. It reads as absent;
	// a caller should distrust the response's other counts too.
	BadUsage bool
	// Items is the number of results of a non-generating call (embeddings).
	Items int
	// Error reports an error object inside the stream or body.
	Error bool
	// Timings are server-side durations reported by the backend.
	Timings Timings
}

// Timings are the server-side durations a backend reports about one request.
// A zero Timings reports nothing; when Set, a negative field is absent.
type Timings struct {
	Set     bool
	Queue   time.Duration // waiting in the server's queue
	Load    time.Duration // loading the model (Ollama)
	Prefill time.Duration // processing the prompt
	Decode  time.Duration // generating the output
	// TTFT is the server's own time to first token, from when it scheduled
	// the request (vLLM's per-request metrics).
	TTFT time.Duration
}

// maxCount bounds a token count: no model's context holds 2^31 tokens.
const maxCount = 1<<31 - 1

// count reads a token count: absent or null reads as absent; a whole
// number from 0 to maxCount as itself; anything else (negative, a
// fraction, a string, 1e30) as absent, marking BadUsage.
func (o *Obs) count(v gjson.Result) (bool, int) {
	if !v.Exists() || v.Type == gjson.Null {
		return false, 0
	}
	if f := v.Num; v.Type != gjson.Number || !(f >= 0 && f <= maxCount) || f != math.Trunc(f) {
		o.BadUsage = true
		return false, 0
	}
	return true, int(v.Num)
}

func noTimings() Timings {
	return Timings{Set: true, Queue: -1, Load: -1, Prefill: -1, Decode: -1, TTFT: -1}
}

// Dialect reads one API's requests, events and bodies.
type Dialect interface {
	// Name is the dialect's name as it appears in records, docs and config.
	Name() string
	// Request reads the request's path (without query) and body.
	Request(path, body []byte) Request
	// Event reads one SSE event (its type and data) or NDJSON line (typ nil).
	Event(typ, data []byte) Obs
	// Body reads a complete non-streamed response body. Its Token and
	// Answer are meaningless (a body has no timing) and callers ignore them.
	Body(body []byte) Obs
}

// HeaderReader is implemented by dialects whose backends report timings in
// response headers (TGI's x-queue-time and friends).
type HeaderReader interface {
	Header(get func(name string) []byte) Timings
}

// Request is what the request says about the call.
type Request struct {
	// Model is the model asked for, aliasing the body or path where it can.
	Model []byte
	// Stream reports a streamed call.
	Stream bool
	// Items is the number of inputs of an embeddings call.
	Items int
	// Dup names a member read here ("model" or "stream") that the body's
	// top level gives more than once, under any spelling that decodes to
	// it; "" when none. A decoder that keeps the last value (Go's,
	// pydantic's) would serve another model than the first names, so
	// such a body cannot be routed, priced or checked.
	Dup string
}

// All lists every dialect, by name.
var All = []Dialect{OpenAI, Responses, Embeddings, Anthropic, Gemini, Ollama, TGI, LlamaCpp, Generic}

// ByName returns the dialect with the given name, or nil.
func ByName(name string) Dialect {
	for _, d := range All {
		if d.Name() == name {
			return d
		}
	}
	return nil
}

// ForPath picks the dialect for a request path (without the query).
// Unknown paths get Generic, which still measures the stream.
func ForPath(path []byte) Dialect {
	has := func(s string) bool { return bytes.HasSuffix(path, []byte(s)) }
	switch {
	case has("/chat/completions"), has("/completions"):
		return OpenAI
	case has("/responses"):
		return Responses
	case has("/embeddings"):
		return Embeddings
	case has("/messages"):
		return Anthropic
	case bytes.Contains(path, []byte(":generateContent")), bytes.Contains(path, []byte(":streamGenerateContent")):
		return Gemini
	case has("/api/chat"), has("/api/generate"):
		return Ollama
	case has("/generate_stream"), has("/generate"):
		return TGI
	case has("/completion"):
		return LlamaCpp
	}
	return Generic
}

// modelAndStream reads the "model" and "stream" members of a JSON body's
// top level in one pass; stream is def when absent. A member given twice
// is named in Dup, the first value kept.
func modelAndStream(body []byte, def bool) Request {
	r := Request{Stream: def}
	b := bytes.TrimSpace(body)
	if len(b) == 0 || b[0] != '{' {
		return r
	}
	var seenModel, seenStream bool
	gjson.Parse(str(b)).ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "model":
			if seenModel {
				r.Dup = "model"
				return false
			}
			seenModel = true
			r.Model = stringView(b, v)
		case "stream":
			if seenStream {
				r.Dup = "stream"
				return false
			}
			seenStream = true
			r.Stream = v.Bool()
		}
		return true
	})
	return r
}

// stringView returns a JSON string value as a view into src when it has no
// escapes, or as a copy.
func stringView(src []byte, v gjson.Result) []byte {
	if v.Type != gjson.String {
		return nil
	}
	if v.Index > 0 && strings.IndexByte(v.Raw, '\\') < 0 {
		return src[v.Index+1 : v.Index+len(v.Raw)-1]
	}
	return []byte(v.Str)
}

// str views b as a string without copying. The string must not outlive b's
// contents, which is why no gjson result leaves this package.
func str(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

// object returns data as a string when it holds a JSON object, else "".
func object(data []byte) string {
	data = bytes.TrimSpace(data)
	if len(data) == 0 || data[0] != '{' {
		return ""
	}
	return str(data)
}

func nonEmptyString(r gjson.Result) bool {
	return r.Type == gjson.String && len(r.Raw) > 2
}

func nonEmptyArray(r gjson.Result) bool {
	if !r.IsArray() {
		return false
	}
	for i := 1; i < len(r.Raw); i++ {
		switch r.Raw[i] {
		case ' ', '\t', '\n', '\r':
		default:
			return r.Raw[i] != ']'
		}
	}
	return false
}

// present reports a member that exists and is not null.
func present(r gjson.Result) bool { return r.Exists() && r.Type != gjson.Null }

// millis converts a JSON number of milliseconds.
func millis(r gjson.Result) time.Duration {
	if !r.Exists() {
		return -1
	}
	return time.Duration(r.Float() * float64(time.Millisecond))
}

// nanos converts a JSON number of nanoseconds.
func nanos(r gjson.Result) time.Duration {
	if !r.Exists() {
		return -1
	}
	return time.Duration(r.Int())
}

var done = []byte("[DONE]")

// genericDialect counts every event or line as a token event.
type genericDialect struct{}

// Generic measures any stream: each SSE event or NDJSON line (but a literal
// [DONE]) is a token event and an answer; output tokens are counted. Records
// of this dialect say so, as their token figures are estimates.
var Generic Dialect = genericDialect{}

func (genericDialect) Name() string { return "generic" }

func (genericDialect) Request(_, body []byte) Request {
	if object(body) == "" {
		return Request{}
	}
	return modelAndStream(body, false)
}

func (genericDialect) Event(_, data []byte) Obs {
	if bytes.Equal(bytes.TrimSpace(data), done) {
		return Obs{}
	}
	return Obs{Token: true, Answer: true}
}

func (genericDialect) Body([]byte) Obs { return Obs{} }

// MaxOutputTokens returns the output limit a JSON request body declares
// (max_tokens, max_completion_tokens, max_output_tokens, Gemini's
// generationConfig.maxOutputTokens, Ollama's options.num_predict, TGI's
// parameters.max_new_tokens, llama.cpp's n_predict): the first of them, in
// the body's order, that holds a positive number; or 0. It reads the body's
// top-level members once.
func MaxOutputTokens(body []byte) int {
	s := object(body)
	if s == "" {
		return 0
	}
	n := 0
	positive := func(v gjson.Result) bool {
		if v.Type == gjson.Number && v.Int() > 0 {
			n = int(v.Int())
			return true
		}
		return false
	}
	gjson.Parse(s).ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict":
			return !positive(v)
		case "generationConfig":
			return !positive(gjson.Get(v.Raw, "maxOutputTokens"))
		case "options":
			return !positive(gjson.Get(v.Raw, "num_predict"))
		case "parameters":
			return !positive(gjson.Get(v.Raw, "max_new_tokens"))
		}
		return true
	})
	return n
}
