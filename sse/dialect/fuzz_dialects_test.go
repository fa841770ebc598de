package dialect

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokentap/tokentap/sse"
)

// Reference readings with encoding/json, one per dialect, of the predicates
// documented on each dialect. ok=false skips inputs where the two readings
// may legitimately differ (numbers that are not small integers).

func at(v any, path string) any {
	for _, k := range strings.Split(path, ".") {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

func has(v any, path string) bool {
	i := strings.LastIndexByte(path, '.')
	parent := v
	if i >= 0 {
		parent = at(v, path[:i])
	}
	m, ok := parent.(map[string]any)
	if !ok {
		return false
	}
	_, ok = m[path[i+1:]]
	return ok
}

func str1(v any) bool { s, ok := v.(string); return ok && s != "" }

func arr1(v any) bool { a, ok := v.([]any); return ok && len(a) > 0 }

// num reads an integer member; ok=false when it is present but not a small integer.
func num(v any, path string) (n int, present, ok bool) {
	if !has(v, path) {
		return 0, false, true
	}
	n, ok = smallInt(at(v, path), true)
	return n, true, ok
}

func setIn(o *Obs, doc any, path string) bool {
	n, p, ok := num(doc, path)
	if p {
		o.HasIn, o.In = true, n
	}
	return ok
}

func setOut(o *Obs, doc any, path string) bool {
	n, p, ok := num(doc, path)
	if p {
		o.HasOut, o.Out = true, n
	}
	return ok
}

func setCached(o *Obs, doc any, path string) bool {
	n, p, ok := num(doc, path)
	if p {
		o.HasCached, o.Cached = true, n
	}
	return ok
}

func refResponses(doc map[string]any) (Obs, bool) {
	var o Obs
	switch doc["type"] {
	case "response.output_text.delta", "response.refusal.delta", "response.function_call_arguments.delta", "response.custom_tool_call_input.delta":
		o.Token, o.Answer = str1(doc["delta"]), str1(doc["delta"])
	case "response.reasoning_text.delta", "response.reasoning_summary_text.delta":
		o.Token = str1(doc["delta"])
	case "response.completed", "response.incomplete", "response.failed":
		if _, isObj := at(doc, "response.usage").(map[string]any); isObj {
			if !setIn(&o, doc, "response.usage.input_tokens") || !setOut(&o, doc, "response.usage.output_tokens") ||
				!setCached(&o, doc, "response.usage.input_tokens_details.cached_tokens") {
				return o, false
			}
			n, p, ok := num(doc, "response.usage.output_tokens_details.reasoning_tokens")
			if !ok {
				return o, false
			}
			o.HasReasoning, o.Reasoning = p, n
		}
		o.Error = doc["type"] == "response.failed"
	case "error":
		o.Error = true
	}
	return o, true
}

func refAnthropic(doc map[string]any) (Obs, bool) {
	var o Obs
	switch doc["type"] {
	case "content_block_delta":
		switch at(doc, "delta.type") {
		case "text_delta":
			o.Token, o.Answer = str1(at(doc, "delta.text")), str1(at(doc, "delta.text"))
		case "input_json_delta":
			o.Token, o.Answer = str1(at(doc, "delta.partial_json")), str1(at(doc, "delta.partial_json"))
		case "thinking_delta":
			o.Token = str1(at(doc, "delta.thinking"))
		}
	case "message_start":
		if _, isObj := at(doc, "message.usage").(map[string]any); isObj && has(doc, "message.usage.input_tokens") {
			a, _, ok1 := num(doc, "message.usage.input_tokens")
			b, _, ok2 := num(doc, "message.usage.cache_creation_input_tokens")
			c, _, ok3 := num(doc, "message.usage.cache_read_input_tokens")
			o.HasIn, o.In = true, a+b+c
			if !ok1 || !ok2 || !ok3 || !setCached(&o, doc, "message.usage.cache_read_input_tokens") {
				return o, false
			}
			if has(doc, "message.usage.cache_creation_input_tokens") {
				o.HasCacheWrite, o.CacheWrite = true, b
			}
		}
	case "message_delta":
		if !setOut(&o, doc, "usage.output_tokens") {
			return o, false
		}
		if has(doc, "usage.input_tokens") {
			return o, false // rare; covered by the table tests
		}
	case "error":
		o.Error = true
	}
	return o, true
}

func refGemini(doc map[string]any) (Obs, bool) {
	var o Obs
	if cands, ok := doc["candidates"].([]any); ok {
		for _, c := range cands {
			parts, _ := at(c, "content.parts").([]any)
			for _, p := range parts {
				_, isCall := at(p, "functionCall").(map[string]any)
				if str1(at(p, "text")) || isCall {
					o.Token = true
					if th, _ := at(p, "thought").(bool); !th {
						o.Answer = true
					}
				}
			}
		}
	}
	if _, isObj := doc["usageMetadata"].(map[string]any); isObj {
		if !setIn(&o, doc, "usageMetadata.promptTokenCount") || !setCached(&o, doc, "usageMetadata.cachedContentTokenCount") {
			return o, false
		}
		c, pc, ok1 := num(doc, "usageMetadata.candidatesTokenCount")
		t, pt, ok2 := num(doc, "usageMetadata.thoughtsTokenCount")
		if !ok1 || !ok2 {
			return o, false
		}
		if pc || pt {
			o.HasOut, o.Out = true, c+t
		}
		if pt {
			o.HasReasoning, o.Reasoning = true, t
		}
	}
	_, o.Error = doc["error"].(map[string]any)
	return o, true
}

func refOllama(doc map[string]any) (Obs, bool) {
	var o Obs
	switch {
	case str1(at(doc, "message.content")), str1(doc["response"]), arr1(at(doc, "message.tool_calls")):
		o.Token, o.Answer = true, true
	case str1(at(doc, "message.thinking")), str1(doc["thinking"]):
		o.Token = true
	}
	if d, _ := doc["done"].(bool); d {
		if !setIn(&o, doc, "prompt_eval_count") || !setOut(&o, doc, "eval_count") {
			return o, false
		}
		if has(doc, "load_duration") || has(doc, "prompt_eval_duration") || has(doc, "eval_duration") {
			return o, false // durations: covered by the table tests
		}
	}
	o.Error = doc["error"] != nil
	return o, true
}

func refTGI(doc map[string]any) (Obs, bool) {
	var o Obs
	if tok, ok := doc["token"].(map[string]any); ok {
		if sp, _ := tok["special"].(bool); !sp {
			o.Token, o.Answer = true, true
		}
	}
	if !setOut(&o, doc, "details.generated_tokens") {
		return o, false
	}
	o.Error = doc["error"] != nil
	return o, true
}

func refLlama(doc map[string]any) (Obs, bool) {
	var o Obs
	o.Token, o.Answer = str1(doc["content"]), str1(doc["content"])
	if has(doc, "timings") || !setIn(&o, doc, "tokens_evaluated") || !setOut(&o, doc, "tokens_predicted") || !setCached(&o, doc, "tokens_cached") {
		return o, false
	}
	o.Error = doc["error"] != nil
	return o, true
}

// fuzzDialect seeds the fuzzer with the dialect's fixtures (their expected
// records are checked through the relay's meter, in the proxy package:
// TestDialectFixturesThroughTheMeter) and checks that
// the event reader never panics and agrees with the reference on valid JSON.
func fuzzDialect(f *testing.F, d Dialect, ref func(map[string]any) (Obs, bool)) {
	wants, _ := filepath.Glob("testdata/*.want.json")
	for _, wf := range wants {
		raw, _ := os.ReadFile(wf)
		var w struct{ Dialect, Framing string }
		if json.Unmarshal(raw, &w) != nil || w.Dialect != d.Name() || w.Framing == "body" {
			continue
		}
		name := strings.TrimSuffix(filepath.Base(wf), ".want.json")
		for _, ext := range []string{".sse", ".ndjson"} {
			data, err := os.ReadFile(filepath.Join("testdata", name+ext))
			if err != nil {
				continue
			}
			if ext == ".sse" {
				p := sse.NewParser(1 << 20)
				p.Feed(data)
				for p.Next() {
					f.Add(append([]byte(nil), p.Event().Data...))
				}
			} else {
				for _, line := range strings.Split(string(data), "\n") {
					f.Add([]byte(line))
				}
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := d.Event(nil, data)
		_ = d.Body(data)
		if len(data) == 0 || data[0] != '{' || !json.Valid(data) || hasDuplicateKeys(data) {
			return
		}
		var doc map[string]any
		if json.Unmarshal(data, &doc) != nil {
			return
		}
		want, ok := ref(doc)
		if !ok {
			return
		}
		got.Timings = Timings{}
		if got != want {
			t.Fatalf("%s:\n gjson %+v\n  json %+v", data, got, want)
		}
	})
}

func FuzzResponsesEvent(f *testing.F) { fuzzDialect(f, Responses, refResponses) }
func FuzzAnthropicEvent(f *testing.F) { fuzzDialect(f, Anthropic, refAnthropic) }
func FuzzGeminiEvent(f *testing.F)    { fuzzDialect(f, Gemini, refGemini) }
func FuzzOllamaEvent(f *testing.F)    { fuzzDialect(f, Ollama, refOllama) }
func FuzzTGIEvent(f *testing.F)       { fuzzDialect(f, TGI, refTGI) }
func FuzzLlamaCppEvent(f *testing.F)  { fuzzDialect(f, LlamaCpp, refLlama) }

func refEmbeddingsBody(doc map[string]any) (Obs, bool) {
	var o Obs
	if d, ok := doc["data"].([]any); ok {
		o.Items = len(d)
	}
	if _, isObj := doc["usage"].(map[string]any); isObj {
		if !setIn(&o, doc, "usage.prompt_tokens") {
			return o, false
		}
		o.HasOut = true
	}
	o.Error = doc["error"] != nil
	return o, true
}

// FuzzEmbeddingsBody checks the embeddings body reader, the one extractor
// that never sees events.
func FuzzEmbeddingsBody(f *testing.F) {
	if b, err := os.ReadFile("testdata/embeddings.json"); err == nil {
		f.Add(b)
	}
	f.Add([]byte(`{"data":[],"usage":{"prompt_tokens":0}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		got := Embeddings.Body(data)
		if len(data) == 0 || data[0] != '{' || !json.Valid(data) || hasDuplicateKeys(data) {
			return
		}
		var doc map[string]any
		if json.Unmarshal(data, &doc) != nil {
			return
		}
		if want, ok := refEmbeddingsBody(doc); ok && got != want {
			t.Fatalf("%s:\n gjson %+v\n  json %+v", data, got, want)
		}
	})
}
