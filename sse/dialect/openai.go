package dialect

import (
	"github.com/tidwall/gjson"
)

// openAI reads /v1/chat/completions and /v1/completions, streamed or not.
//
// Token event: a chunk with a choice whose delta.content, text,
// delta.reasoning_content or delta.reasoning is a non-empty string, or whose
// delta.tool_calls is a non-empty array. A role-only first chunk, empty
// deltas, comments, the usage-only chunk and [DONE] are not token events.
// Answer: content, text or tool_calls (reasoning alone is not an answer).
// Usage: the "usage" object (prompt_tokens, completion_tokens) of a body or
// of a chunk (the include_usage chunk, or every chunk with vLLM's continuous
// usage stats; the last one wins).
// Error: a top-level "error" member that is not null.
// Timings: llama.cpp's server adds "timings" (prompt_ms, predicted_ms).
type openAI struct{}

// OpenAI is the dialect of OpenAI chat completions and completions.
var OpenAI Dialect = openAI{}

func (openAI) Name() string { return "openai" }

func (openAI) Request(_, body []byte) Request { return modelAndStream(body, false) }

func (openAI) Event(_, data []byte) Obs { return readOpenAI(object(data)) }

func (openAI) Body(body []byte) Obs { return readOpenAI(object(body)) }

func readOpenAI(s string) Obs {
	var o Obs
	if s == "" {
		return o
	}
	if choices := gjson.Get(s, "choices"); choices.IsArray() {
		choices.ForEach(func(_, c gjson.Result) bool {
			readChoice(c.Raw, &o)
			return true
		})
	}
	if usage := gjson.Get(s, "usage"); usage.IsObject() {
		readUsage(usage.Raw, "prompt_tokens", "completion_tokens", &o)
	}
	if present(gjson.Get(s, "error")) {
		o.Error = true
	}
	if t := gjson.Get(s, "timings"); t.IsObject() {
		o.Timings = llamaTimings(t.Raw)
	}
	return o
}

func readChoice(c string, o *Obs) {
	if nonEmptyString(gjson.Get(c, "delta.content")) || nonEmptyString(gjson.Get(c, "text")) ||
		nonEmptyArray(gjson.Get(c, "delta.tool_calls")) {
		o.Token, o.Answer = true, true
		return
	}
	if nonEmptyString(gjson.Get(c, "delta.reasoning_content")) || nonEmptyString(gjson.Get(c, "delta.reasoning")) {
		o.Token = true
	}
}

// readUsage reads input and output token counts from a usage object.
func readUsage(u, in, out string, o *Obs) {
	if v := gjson.Get(u, in); v.Exists() {
		o.HasIn, o.In = true, int(v.Int())
	}
	if v := gjson.Get(u, out); v.Exists() {
		o.HasOut, o.Out = true, int(v.Int())
	}
}
