package dialect

import "github.com/tidwall/gjson"

// responses reads the OpenAI Responses API, /v1/responses.
//
// Streamed, each event's data has a "type":
// token and answer: response.output_text.delta, response.refusal.delta,
// response.function_call_arguments.delta, response.custom_tool_call_input.delta
// (with a non-empty "delta"); token only: response.reasoning_text.delta,
// response.reasoning_summary_text.delta. Usage: response.usage
// (input_tokens, output_tokens) of response.completed, response.incomplete
// or response.failed. Error: response.failed, or an event of type "error".
// Not streamed: the body's usage, and an error when status is "failed" or
// "error" is not null.
type responses struct{}

// Responses is the dialect of the OpenAI Responses API.
var Responses Dialect = responses{}

func (responses) Name() string { return "openai-responses" }

func (responses) Request(_, body []byte) Request { return modelAndStream(body, false) }

func (responses) Event(_, data []byte) Obs {
	var o Obs
	s := object(data)
	if s == "" {
		return o
	}
	switch typ := gjson.Get(s, "type").Str; typ {
	case "response.output_text.delta", "response.refusal.delta",
		"response.function_call_arguments.delta", "response.custom_tool_call_input.delta":
		if nonEmptyString(gjson.Get(s, "delta")) {
			o.Token, o.Answer = true, true
		}
	case "response.reasoning_text.delta", "response.reasoning_summary_text.delta":
		if nonEmptyString(gjson.Get(s, "delta")) {
			o.Token = true
		}
	case "response.completed", "response.incomplete", "response.failed":
		if u := gjson.Get(s, "response.usage"); u.IsObject() {
			readUsage(u.Raw, "input_tokens", "output_tokens", &o)
		}
		o.Error = typ == "response.failed"
	case "error":
		o.Error = true
	}
	return o
}

func (responses) Body(body []byte) Obs {
	var o Obs
	s := object(body)
	if s == "" {
		return o
	}
	if u := gjson.Get(s, "usage"); u.IsObject() {
		readUsage(u.Raw, "input_tokens", "output_tokens", &o)
	}
	o.Error = gjson.Get(s, "status").Str == "failed" || present(gjson.Get(s, "error"))
	return o
}

// embeddings reads /v1/embeddings: never streamed, no output tokens.
// Items: the number of entries of "data" in the response (the request's
// input count when the response has none). Usage: usage.prompt_tokens.
type embeddings struct{}

// Embeddings is the dialect of OpenAI-style embeddings.
var Embeddings Dialect = embeddings{}

func (embeddings) Name() string { return "openai-embeddings" }

func (embeddings) Request(_, body []byte) Request {
	r := modelAndStream(body, false)
	r.Stream = false
	switch in := gjson.Get(str(body), "input"); {
	case in.Type == gjson.String:
		r.Items = 1
	case in.IsArray():
		// A list of strings or of token lists is one item each; a list of
		// numbers is a single tokenized input.
		if first := gjson.Get(in.Raw, "0"); first.Type == gjson.Number {
			r.Items = 1
		} else {
			r.Items = int(gjson.Get(in.Raw, "#").Int())
		}
	}
	return r
}

func (embeddings) Event(_, data []byte) Obs { return OpenAI.Event(nil, data) }

func (embeddings) Body(body []byte) Obs {
	var o Obs
	s := object(body)
	if s == "" {
		return o
	}
	if d := gjson.Get(s, "data"); d.IsArray() {
		o.Items = int(gjson.Get(d.Raw, "#").Int())
	}
	if u := gjson.Get(s, "usage"); u.IsObject() {
		if v := gjson.Get(u.Raw, "prompt_tokens"); v.Exists() {
			o.HasIn, o.In = o.count(v)
		}
		o.HasOut = true
	}
	o.Error = present(gjson.Get(s, "error"))
	return o
}
