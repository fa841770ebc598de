package dialect

import "github.com/tidwall/gjson"

// llamaCpp reads llama.cpp server's native /completion, streamed (SSE) or
// not. (Its /v1/chat/completions is read by the OpenAI dialect, which also
// takes the "timings" llama.cpp adds there.)
//
// Token event: an event with a non-empty "content" (a token and an answer).
// Usage on the final event ("stop": true) or body: tokens_evaluated in,
// tokens_predicted out (or timings.prompt_n / predicted_n). Timings:
// timings.prompt_ms (prefill) and timings.predicted_ms (decode). Error: an
// "error" member.
type llamaCpp struct{}

// LlamaCpp is the dialect of llama.cpp's native completion API.
var LlamaCpp Dialect = llamaCpp{}

func (llamaCpp) Name() string { return "llamacpp" }

func (llamaCpp) Request(_, body []byte) Request { return modelAndStream(body, false) }

func (llamaCpp) Event(_, data []byte) Obs { return readLlama(object(data)) }

func (llamaCpp) Body(body []byte) Obs { return readLlama(object(body)) }

func readLlama(s string) Obs {
	var o Obs
	if s == "" {
		return o
	}
	if nonEmptyString(gjson.Get(s, "content")) {
		o.Token, o.Answer = true, true
	}
	t := gjson.Get(s, "timings")
	if v := gjson.Get(s, "tokens_evaluated"); v.Exists() {
		o.HasIn, o.In = o.count(v)
	} else if v := gjson.Get(t.Raw, "prompt_n"); t.IsObject() && v.Exists() {
		o.HasIn, o.In = o.count(v)
	}
	if v := gjson.Get(s, "tokens_cached"); v.Exists() {
		o.HasCached, o.Cached = o.count(v)
	} else if v := gjson.Get(t.Raw, "cache_n"); t.IsObject() && v.Exists() {
		o.HasCached, o.Cached = o.count(v)
	}
	if v := gjson.Get(s, "tokens_predicted"); v.Exists() {
		o.HasOut, o.Out = o.count(v)
	} else if v := gjson.Get(t.Raw, "predicted_n"); t.IsObject() && v.Exists() {
		o.HasOut, o.Out = o.count(v)
	}
	if t.IsObject() {
		o.Timings = llamaTimings(t.Raw)
	}
	if present(gjson.Get(s, "error")) {
		o.Error = true
	}
	return o
}

func llamaTimings(t string) Timings {
	tm := noTimings()
	tm.Prefill = millis(gjson.Get(t, "prompt_ms"))
	tm.Decode = millis(gjson.Get(t, "predicted_ms"))
	return tm
}
