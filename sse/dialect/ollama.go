package dialect

import "github.com/tidwall/gjson"

// ollama reads Ollama's native /api/chat and /api/generate: NDJSON lines
// when streamed (Ollama's default), one JSON object when "stream": false.
//
// Token event: a line whose message.content (chat) or response (generate)
// is non-empty, or with message.tool_calls: a token and an answer; a line
// with a non-empty message.thinking or thinking only: a token. Usage on the
// final line ("done": true): prompt_eval_count in, eval_count out. Timings
// (nanoseconds on the final line): load_duration, prompt_eval_duration
// (prefill) and eval_duration (decode). Error: an "error" member.
type ollama struct{}

// Ollama is the dialect of Ollama's native API.
var Ollama Dialect = ollama{}

func (ollama) Name() string { return "ollama" }

func (ollama) Request(_, body []byte) Request { return modelAndStream(body, true) }

func (ollama) Event(_, data []byte) Obs { return readOllama(object(data)) }

func (ollama) Body(body []byte) Obs { return readOllama(object(body)) }

func readOllama(s string) Obs {
	var o Obs
	if s == "" {
		return o
	}
	switch {
	case nonEmptyString(gjson.Get(s, "message.content")), nonEmptyString(gjson.Get(s, "response")),
		nonEmptyArray(gjson.Get(s, "message.tool_calls")):
		o.Token, o.Answer = true, true
	case nonEmptyString(gjson.Get(s, "message.thinking")), nonEmptyString(gjson.Get(s, "thinking")):
		o.Token = true
	}
	if gjson.Get(s, "done").Type == gjson.True { // the JSON true only: gjson reads 1 and "true" as true too
		if v := gjson.Get(s, "prompt_eval_count"); v.Exists() {
			o.HasIn, o.In = o.count(v)
		}
		if v := gjson.Get(s, "eval_count"); v.Exists() {
			o.HasOut, o.Out = o.count(v)
		}
		t := noTimings()
		t.Load = nanos(gjson.Get(s, "load_duration"))
		t.Prefill = nanos(gjson.Get(s, "prompt_eval_duration"))
		t.Decode = nanos(gjson.Get(s, "eval_duration"))
		if t.Load >= 0 || t.Prefill >= 0 || t.Decode >= 0 {
			o.Timings = t
		}
	}
	if present(gjson.Get(s, "error")) {
		o.Error = true
	}
	return o
}
