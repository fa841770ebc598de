package dialect

import (
	"testing"
)

func TestOpenAIEvent(t *testing.T) {
	f := func(name, data string, want Obs) {
		t.Helper()
		if got := OpenAI.Event(nil, []byte(data)); got != want {
			t.Errorf("%s: got %+v want %+v", name, got, want)
		}
	}
	tok := Obs{Token: true, Answer: true}
	f("content", `{"choices":[{"index":0,"delta":{"content":"Hi"}}]}`, tok)
	f("role only", `{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`, Obs{})
	f("role only no content", `{"choices":[{"index":0,"delta":{"role":"assistant"}}]}`, Obs{})
	f("empty delta", `{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`, Obs{})
	f("completions text", `{"choices":[{"index":0,"text":" the"}]}`, tok)
	f("completions empty text", `{"choices":[{"index":0,"text":""}]}`, Obs{})
	f("tool call", `{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\""}}]}}]}`, tok)
	f("empty tool calls", `{"choices":[{"delta":{"tool_calls":[ ]}}]}`, Obs{})
	f("reasoning_content", `{"choices":[{"delta":{"reasoning_content":"hmm"}}]}`, Obs{Token: true})
	f("reasoning", `{"choices":[{"delta":{"reasoning":"hmm"}}]}`, Obs{Token: true})
	f("second choice", `{"choices":[{"delta":{}},{"delta":{"content":"x"}}]}`, tok)
	f("usage only", `{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}`,
		Obs{HasIn: true, In: 12, HasOut: true, Out: 34})
	f("usage with cached prefix", `{"choices":[],"usage":{"prompt_tokens":2006,"completion_tokens":300,"prompt_tokens_details":{"cached_tokens":1920}}}`,
		Obs{HasIn: true, In: 2006, HasOut: true, Out: 300, HasCached: true, Cached: 1920})
	f("usage with reasoning", `{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":300,"completion_tokens_details":{"reasoning_tokens":256}}}`,
		Obs{HasIn: true, In: 20, HasOut: true, Out: 300, HasReasoning: true, Reasoning: 256})
	f("usage null", `{"choices":[{"delta":{"content":"a"}}],"usage":null}`, tok)
	f("continuous usage", `{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`,
		Obs{Token: true, Answer: true, HasIn: true, In: 3, HasOut: true, Out: 1})
	f("done", `[DONE]`, Obs{})
	f("error", `{"error":{"message":"boom","type":"server_error"}}`, Obs{Error: true})
	f("not json", `hello`, Obs{})
	f("broken json", `{"choices":[{"delta":{"content":"a`, Obs{})
}

func TestOpenAIBody(t *testing.T) {
	body := []byte(`{"id":"x","choices":[{"message":{"role":"assistant","content":"Hello"}}],"usage":{"prompt_tokens":5,"completion_tokens":7}}` + "\n")
	if got := OpenAI.Body(body); !got.HasIn || !got.HasOut || got.In != 5 || got.Out != 7 || got.Token {
		t.Fatalf("got %+v", got)
	}
}

func TestReadRequest(t *testing.T) {
	r := OpenAI.Request(nil, []byte(`{"model":"llama-3","stream":true,"messages":[]}`))
	if string(r.Model) != "llama-3" || !r.Stream {
		t.Fatalf("got %q %v", r.Model, r.Stream)
	}
	r = OpenAI.Request(nil, []byte(`{"messages":[],"model":"a\/b"}`))
	if string(r.Model) != "a/b" || r.Stream {
		t.Fatalf("escaped: got %q %v", r.Model, r.Stream)
	}
	if r = OpenAI.Request(nil, []byte(`not json`)); r.Model != nil {
		t.Fatalf("garbage: got %q", r.Model)
	}
	if r = OpenAI.Request(nil, []byte("  \n{\"model\":\"m\\u0031\"}\n ")); string(r.Model) != "m1" || r.Dup != "" {
		t.Fatalf("spaced: got %q, dup %q", r.Model, r.Dup)
	}
}

// TestDuplicateMembers: a body that gives "model" or "stream" twice at its
// top level, under any spelling that decodes to the name, is flagged; the
// same names nested, or given once, are not.
func TestDuplicateMembers(t *testing.T) {
	for body, want := range map[string]string{
		`{"model":"cheap","model":"gpt-4o"}`:                         "model",
		`{"model":"cheap","messages":[],"m\u006fdel":"gpt-4o"}`:      "model",
		`{"stream":false,"model":"m","stream":true}`:                 "stream",
		`{"model":"m","stream":true,"messages":[{"model":"other"}]}`: "",
		`{"model":"m","metadata":{"model":"x","stream":1}}`:          "",
		`{"model":null,"model":"x"}`:                                 "model",
		`["model","model"]`:                                          "",
	} {
		for _, d := range []Dialect{OpenAI, Anthropic, Responses, Ollama, LlamaCpp, Embeddings, Generic} {
			if got := d.Request(nil, []byte(body)).Dup; got != want {
				t.Errorf("%s %s: dup %q, want %q", d.Name(), body, got, want)
			}
		}
	}
}

func TestForPath(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/chat/completions": "openai", "/v1/completions": "openai", "/openai/v1/chat/completions": "openai",
		"/v1/responses": "openai-responses", "/v1/embeddings": "openai-embeddings", "/v1/messages": "anthropic",
		"/v1beta/models/gemini-2.5-flash:streamGenerateContent": "gemini", "/v1beta/models/g:generateContent": "gemini",
		"/api/chat": "ollama", "/api/generate": "ollama", "/generate_stream": "tgi", "/generate": "tgi",
		"/completion": "llamacpp", "/v1/audio/speech": "generic", "/": "generic",
	} {
		if got := ForPath([]byte(path)).Name(); got != want {
			t.Errorf("%s: got %s want %s", path, got, want)
		}
	}
}

func TestOpenAIEventAllocs(t *testing.T) {
	data := []byte(`{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}`)
	if a := testing.AllocsPerRun(100, func() { OpenAI.Event(nil, data) }); a != 0 {
		t.Fatalf("allocs per event = %v, want 0", a)
	}
}

func BenchmarkOpenAIEvent(b *testing.B) {
	data := []byte(`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		OpenAI.Event(nil, data)
	}
}

// A non-streamed body as a small completion returns it.
func BenchmarkOpenAIBody(b *testing.B) {
	data := []byte(`{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"the quick brown fox"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":4,"total_tokens":16}}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		OpenAI.Body(data)
	}
}

func TestMaxOutputTokens(t *testing.T) {
	for body, want := range map[string]int{
		`{"max_tokens":100}`: 100, `{"max_completion_tokens":7}`: 7, `{"max_output_tokens":9}`: 9,
		`{"generationConfig":{"maxOutputTokens":11}}`: 11, `{"options":{"num_predict":12}}`: 12,
		`{"parameters":{"max_new_tokens":13}}`: 13, `{"n_predict":14}`: 14,
		`{"max_tokens":-1,"n_predict":5}`: 5, `{}`: 0, `nope`: 0, `{"max_tokens":"100"}`: 0,
	} {
		if got := MaxOutputTokens([]byte(body)); got != want {
			t.Errorf("%s: %d, want %d", body, got, want)
		}
	}
}

// Cached input tokens, where each API says: a reused prefix.
func TestCachedTokens(t *testing.T) {
	for _, c := range []struct {
		name string
		obs  Obs
		want int
	}{
		{"anthropic", Anthropic.Body([]byte(`{"type":"message","content":[],"usage":{"input_tokens":8,"cache_read_input_tokens":2000,"output_tokens":4}}`)), 2000},
		{"responses", Responses.Event([]byte("response.completed"), []byte(`{"type":"response.completed","response":{"usage":{"input_tokens":20,"input_tokens_details":{"cached_tokens":16},"output_tokens":3}}}`)), 16},
		{"gemini", Gemini.Body([]byte(`{"candidates":[],"usageMetadata":{"promptTokenCount":100,"cachedContentTokenCount":64,"candidatesTokenCount":5}}`)), 64},
		{"llama.cpp", LlamaCpp.Body([]byte(`{"content":"hi","tokens_evaluated":50,"tokens_cached":48,"tokens_predicted":2}`)), 48},
		{"llama.cpp timings", LlamaCpp.Body([]byte(`{"content":"hi","timings":{"prompt_n":2,"cache_n":40,"predicted_n":3}}`)), 40},
	} {
		if !c.obs.HasCached || c.obs.Cached != c.want {
			t.Errorf("%s: %+v, want %d cached", c.name, c.obs, c.want)
		}
	}
	if o := OpenAI.Body([]byte(`{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}`)); o.HasCached {
		t.Errorf("no details: %+v says cached", o)
	}
}

// TestUsageThatCannotBeTrue: a count that is not a whole number from 0 to
// 2^31−1 reads as absent and marks BadUsage, in every dialect's usage; a
// null reads as absent and marks nothing.
func TestUsageThatCannotBeTrue(t *testing.T) {
	for _, v := range []string{"1e30", "NaN", "Infinity", "-Inf", "-7", "2.5", `"5"`, "9.3e18", "true", "{}"} {
		for _, c := range []struct {
			d    Dialect
			typ  string
			data string
		}{
			{OpenAI, "", `{"choices":[],"usage":{"prompt_tokens":` + v + `,"completion_tokens":3}}`},
			{Responses, "response.completed", `{"type":"response.completed","response":{"usage":{"input_tokens":4,"output_tokens":` + v + `}}}`},
			{Anthropic, "message_start", `{"type":"message_start","message":{"usage":{"input_tokens":4,"cache_read_input_tokens":` + v + `}}}`},
			{Anthropic, "message_delta", `{"type":"message_delta","usage":{"output_tokens":` + v + `}}`},
			{Gemini, "", `{"usageMetadata":{"promptTokenCount":4,"thoughtsTokenCount":` + v + `}}`},
			{Ollama, "", `{"done":true,"prompt_eval_count":` + v + `,"eval_count":3}`},
			{TGI, "", `{"token":{"text":"x"},"details":{"generated_tokens":` + v + `}}`},
			{LlamaCpp, "", `{"content":"","tokens_predicted":` + v + `}`},
		} {
			o := c.d.Event([]byte(c.typ), []byte(c.data))
			if !o.BadUsage {
				t.Errorf("%s %s: not marked bad", c.d.Name(), c.data)
			}
		}
	}
	if o := OpenAI.Event(nil, []byte(`{"choices":[],"usage":{"prompt_tokens":null,"completion_tokens":3}}`)); o.BadUsage || o.HasIn || !o.HasOut || o.Out != 3 {
		t.Errorf("null: %+v", o)
	}
	if o := OpenAI.Event(nil, []byte(`{"choices":[],"usage":{"prompt_tokens":2147483647,"completion_tokens":1e3}}`)); o.BadUsage || o.In != 2147483647 || o.Out != 1000 {
		t.Errorf("whole numbers: %+v", o)
	}
}
