package dialect

import (
	"bytes"

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
// Error: a top-level "error" member.
type openAI struct{}

// OpenAI is the dialect of OpenAI chat completions and completions.
var OpenAI Dialect = openAI{}

func (openAI) Name() string { return "openai" }

func (openAI) Event(_, data []byte) Obs {
	if len(data) == 0 || data[0] != '{' {
		// [DONE] and anything that is not an object.
		return Obs{}
	}
	return readOpenAI(str(data))
}

func (openAI) Body(body []byte) Obs {
	return readOpenAI(str(bytes.TrimSpace(body)))
}

func readOpenAI(s string) Obs {
	var o Obs
	if choices := gjson.Get(s, "choices"); choices.IsArray() {
		choices.ForEach(func(_, c gjson.Result) bool {
			readChoice(c.Raw, &o)
			return true
		})
	}
	if usage := gjson.Get(s, "usage"); usage.IsObject() {
		in, out := gjson.Get(usage.Raw, "prompt_tokens"), gjson.Get(usage.Raw, "completion_tokens")
		if in.Exists() || out.Exists() {
			o.Usage = true
			o.InputTokens = int(in.Int())
			o.OutputTokens = int(out.Int())
		}
	}
	if e := gjson.Get(s, "error"); e.Exists() && e.Type != gjson.Null {
		o.Error = true
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
