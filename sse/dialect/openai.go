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
// Timings: llama.cpp's server adds "timings" (prompt_ms, predicted_ms);
// vLLM with --enable-per-request-metrics adds "metrics" (queue_time_ms,
// time_to_first_token_ms, generation_time_ms), in a body and in the last
// chunk of a stream.
type openAI struct{}

// OpenAI is the dialect of OpenAI chat completions and completions.
var OpenAI Dialect = openAI{}

func (openAI) Name() string { return "openai" }

func (openAI) Request(_, body []byte) Request { return modelAndStream(body, false) }

func (openAI) Event(_, data []byte) Obs { return readOpenAI(object(data), true) }

// Body skips the choices: a body's Token and Answer are not read (reading
// them was half of the body's cost).
func (openAI) Body(body []byte) Obs { return readOpenAI(object(body), false) }

// readOpenAI reads a chunk or body in one pass over its top-level members
// (the first occurrence of a duplicated member counts, as in gjson.Get);
// the choices only when choices is set.
func readOpenAI(s string, choices bool) Obs {
	var o Obs
	if s == "" {
		return o
	}
	var seen uint8
	gjson.Parse(s).ForEach(func(k, v gjson.Result) bool {
		var bit uint8
		switch k.Str {
		case "choices":
			bit = 1
			if choices && seen&bit == 0 && v.IsArray() {
				v.ForEach(func(_, c gjson.Result) bool {
					readChoice(c.Raw, &o)
					return true
				})
			}
		case "usage":
			bit = 2
			if seen&bit == 0 && v.IsObject() {
				readUsage(v.Raw, "prompt_tokens", "completion_tokens", &o)
			}
		case "error":
			bit = 4
			if seen&bit == 0 && present(v) {
				o.Error = true
			}
		case "timings":
			bit = 8
			if seen&bit == 0 && v.IsObject() {
				o.Timings = llamaTimings(v.Raw)
			}
		case "metrics":
			bit = 16
			if seen&bit == 0 && v.IsObject() {
				o.Timings = vllmMetrics(v.Raw)
			}
		}
		seen |= bit
		return true
	})
	return o
}

// vllmMetrics reads vLLM's per-request metrics (--enable-per-request-
// metrics): the wait in its queue, its time to first token from when it
// scheduled the request, and the decode time from the first output token
// to the last, in milliseconds.
func vllmMetrics(m string) Timings {
	tm := noTimings()
	tm.Queue = millis(gjson.Get(m, "queue_time_ms"))
	tm.TTFT = millis(gjson.Get(m, "time_to_first_token_ms"))
	tm.Decode = millis(gjson.Get(m, "generation_time_ms"))
	return tm
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

// readUsage reads input and output token counts from a usage object, and
// the cached input tokens from its details of the input (OpenAI:
// prompt_tokens_details or input_tokens_details, cached_tokens; vLLM
// reports them there too).
func readUsage(u, in, out string, o *Obs) {
	if v := gjson.Get(u, in); v.Exists() {
		o.HasIn, o.In = o.count(v)
	}
	details := "prompt_tokens_details.cached_tokens"
	if in == "input_tokens" {
		details = "input_tokens_details.cached_tokens"
	}
	if v := gjson.Get(u, details); v.Exists() {
		o.HasCached, o.Cached = o.count(v)
	}
	if v := gjson.Get(u, out); v.Exists() {
		o.HasOut, o.Out = o.count(v)
	}
	reasoning := "completion_tokens_details.reasoning_tokens"
	if out == "output_tokens" {
		reasoning = "output_tokens_details.reasoning_tokens"
	}
	if v := gjson.Get(u, reasoning); v.Exists() {
		o.HasReasoning, o.Reasoning = o.count(v)
	}
}
