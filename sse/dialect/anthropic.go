package dialect

import "github.com/tidwall/gjson"

// anthropic reads the Anthropic Messages API, /v1/messages.
//
// Streamed, by the data's "type" (the SSE event name repeats it):
// content_block_delta with delta.type text_delta (delta.text) or
// input_json_delta (delta.partial_json) is a token and an answer; with
// thinking_delta (delta.thinking) a token only. Usage: message_start's
// message.usage gives input (input_tokens + cache_creation_input_tokens +
// cache_read_input_tokens), message_delta's usage.output_tokens the output
// so far (the last one wins). ping, content_block_start/stop, signature
// deltas and message_stop carry nothing. Error: an event of type "error".
// Not streamed: the body's usage, and an error when its type is "error".
type anthropic struct{}

// Anthropic is the dialect of the Anthropic Messages API.
var Anthropic Dialect = anthropic{}

func (anthropic) Name() string { return "anthropic" }

func (anthropic) Request(_, body []byte) Request { return modelAndStream(body, false) }

func (anthropic) Event(typ, data []byte) Obs {
	var o Obs
	s := object(data)
	if s == "" {
		if string(typ) == "error" {
			o.Error = true
		}
		return o
	}
	switch gjson.Get(s, "type").Str {
	case "content_block_delta":
		switch gjson.Get(s, "delta.type").Str {
		case "text_delta":
			if nonEmptyString(gjson.Get(s, "delta.text")) {
				o.Token, o.Answer = true, true
			}
		case "input_json_delta":
			if nonEmptyString(gjson.Get(s, "delta.partial_json")) {
				o.Token, o.Answer = true, true
			}
		case "thinking_delta":
			if nonEmptyString(gjson.Get(s, "delta.thinking")) {
				o.Token = true
			}
		}
	case "message_start":
		if u := gjson.Get(s, "message.usage"); u.IsObject() {
			anthropicInput(u.Raw, &o)
		}
	case "message_delta":
		if v := gjson.Get(s, "usage.output_tokens"); v.Exists() {
			o.HasOut, o.Out = o.count(v)
		}
		if u := gjson.Get(s, "usage"); u.IsObject() && gjson.Get(u.Raw, "input_tokens").Exists() {
			anthropicInput(u.Raw, &o)
		}
	case "error":
		o.Error = true
	}
	return o
}

func anthropicInput(u string, o *Obs) {
	in := gjson.Get(u, "input_tokens")
	if !in.Exists() {
		return
	}
	read, write := gjson.Get(u, "cache_read_input_tokens"), gjson.Get(u, "cache_creation_input_tokens")
	// The whole prompt: its uncached part, the cache's reads and writes.
	hasIn, n := o.count(in)
	o.HasCached, o.Cached = o.count(read)
	o.HasCacheWrite, o.CacheWrite = o.count(write)
	if hasIn {
		o.HasIn, o.In = true, n+o.Cached+o.CacheWrite
	}
}

func (anthropic) Body(body []byte) Obs {
	var o Obs
	s := object(body)
	if s == "" {
		return o
	}
	if u := gjson.Get(s, "usage"); u.IsObject() {
		anthropicInput(u.Raw, &o)
		if v := gjson.Get(u.Raw, "output_tokens"); v.Exists() {
			o.HasOut, o.Out = o.count(v)
		}
	}
	o.Error = gjson.Get(s, "type").Str == "error"
	return o
}
