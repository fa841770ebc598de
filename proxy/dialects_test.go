package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

// Every dialect end to end: the simulated backend speaks it, tokentap
// relays and measures it. 3 reasoning tokens then 4 answer tokens, 15 ms
// apart, so the first answer comes 45 ms after the first token.
func TestEveryDialectThroughTheProxy(t *testing.T) {
	mock := httptest.NewServer(mockllm.New(mockllm.Options{TokenGap: 15 * time.Millisecond, Jitter: 0.01, PrefillBase: 5 * time.Millisecond}))
	t.Cleanup(mock.Close)
	tp := startProxy(t, mock.URL, nil)

	type want struct {
		dialect      string
		model        string
		stream       bool
		out, in      int // in: -1 = any positive, 0 = none
		source       string
		reasoning    bool // TTFA after TTFT
		serverTiming bool
		items        int
	}
	reason := `,"mock_reasoning_tokens":3`
	cases := []struct {
		name, path, body string
		want
	}{
		{"openai chat stream", "/v1/chat/completions", `{"model":"m1","stream":true,"max_tokens":4,"stream_options":{"include_usage":true}` + reason + `}`,
			want{"openai", "m1", true, 7, -1, "usage", true, false, 0}},
		{"openai chat stream without usage", "/v1/chat/completions", `{"model":"m1","stream":true,"max_tokens":4` + reason + `}`,
			want{"openai", "m1", true, 7, 0, "counted", true, false, 0}},
		{"openai chat", "/v1/chat/completions", `{"model":"m1","max_tokens":4}`,
			want{"openai", "m1", false, 4, -1, "usage", false, false, 0}},
		{"openai completions stream", "/v1/completions", `{"model":"m2","stream":true,"max_tokens":4,"prompt":"x"}`,
			want{"openai", "m2", true, 4, 0, "counted", false, false, 0}},
		{"responses stream", "/v1/responses", `{"model":"r","stream":true,"max_output_tokens":4` + reason + `}`,
			want{"openai-responses", "r", true, 7, -1, "usage", true, false, 0}},
		{"responses", "/v1/responses", `{"model":"r","max_output_tokens":4}`,
			want{"openai-responses", "r", false, 4, -1, "usage", false, false, 0}},
		{"embeddings", "/v1/embeddings", `{"model":"e","input":["a","b","c"]}`,
			want{"openai-embeddings", "e", false, 0, -1, "usage", false, false, 3}},
		{"anthropic stream", "/v1/messages", `{"model":"claude","stream":true,"max_tokens":4` + reason + `}`,
			want{"anthropic", "claude", true, 7, -1, "usage", true, false, 0}},
		{"anthropic", "/v1/messages", `{"model":"claude","max_tokens":4}`,
			want{"anthropic", "claude", false, 4, -1, "usage", false, false, 0}},
		{"gemini sse", "/v1beta/models/gem:streamGenerateContent?alt=sse", `{"generationConfig":{"maxOutputTokens":4}` + reason + `}`,
			want{"gemini", "gem", true, 7, -1, "usage", true, false, 0}},
		{"gemini array stream", "/v1beta/models/gem:streamGenerateContent", `{"generationConfig":{"maxOutputTokens":4}}`,
			want{"gemini", "gem", false, 4, -1, "usage", false, false, 0}},
		{"gemini", "/v1beta/models/gem:generateContent", `{"generationConfig":{"maxOutputTokens":4}}`,
			want{"gemini", "gem", false, 4, -1, "usage", false, false, 0}},
		{"ollama chat", "/api/chat", `{"model":"llama3","options":{"num_predict":4}` + reason + `}`,
			want{"ollama", "llama3", true, 7, -1, "usage", true, true, 0}},
		{"ollama generate unstreamed", "/api/generate", `{"model":"llama3","stream":false,"options":{"num_predict":4}}`,
			want{"ollama", "llama3", false, 4, -1, "usage", false, true, 0}},
		{"tgi stream", "/generate_stream", `{"inputs":"x","parameters":{"max_new_tokens":4}}`,
			want{"tgi", "", true, 4, 0, "usage", false, false, 0}},
		{"tgi", "/generate", `{"inputs":"x","parameters":{"max_new_tokens":4}}`,
			want{"tgi", "", false, 4, 0, "usage", false, true, 0}},
		{"llama.cpp stream", "/completion", `{"prompt":"x","stream":true,"n_predict":4}`,
			want{"llamacpp", "", true, 4, -1, "usage", false, true, 0}},
		{"llama.cpp", "/completion", `{"prompt":"x","n_predict":4}`,
			want{"llamacpp", "", false, 4, -1, "usage", false, true, 0}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			resp, err := http.Post(tp.url+c.path, "application/json", strings.NewReader(c.body))
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			r := tp.rec.next(t)
			w := c.want
			switch {
			case r.Dialect != w.dialect || r.Model != w.model || r.Stream != w.stream || r.Outcome != metrics.OutcomeOK:
				t.Fatalf("dialect/model/stream/outcome: %+v", r)
			case r.OutputTokens != w.out || r.TokensSource != w.source:
				t.Fatalf("output tokens %d (%s), want %d (%s)", r.OutputTokens, r.TokensSource, w.out, w.source)
			case w.in == -1 && r.InputTokens <= 0, w.in == 0 && r.InputTokens != 0:
				t.Fatalf("input tokens %d", r.InputTokens)
			case r.Items != w.items:
				t.Fatalf("items %d, want %d", r.Items, w.items)
			case (r.ServerDecode >= 0 || r.ServerPrefill >= 0) != w.serverTiming:
				t.Fatalf("server timings prefill=%v decode=%v, want present=%v", r.ServerPrefill, r.ServerDecode, w.serverTiming)
			}
			if !w.stream {
				if r.TTFT != metrics.Absent || r.TTFA != metrics.Absent {
					t.Fatalf("unstreamed response with ttft=%v ttfa=%v", r.TTFT, r.TTFA)
				}
				return
			}
			if r.TTFT <= 0 || r.TTFA < r.TTFT || r.Events != w.out {
				t.Fatalf("ttft=%v ttfa=%v events=%d", r.TTFT, r.TTFA, r.Events)
			}
			if w.reasoning && r.TTFA-r.TTFT < 40*time.Millisecond {
				t.Fatalf("first answer %v after first token, want ≈ 45ms (3 reasoning tokens)", r.TTFA-r.TTFT)
			}
			if !w.reasoning && r.TTFA != r.TTFT {
				t.Fatalf("no reasoning, yet ttfa %v != ttft %v", r.TTFA, r.TTFT)
			}
		})
	}
}

// Errors inside a 200 stream make the outcome upstream_error, per dialect.
func TestErrorInsideStream(t *testing.T) {
	cases := map[string]struct{ path, ctype, body string }{
		"openai":    {"/v1/chat/completions", "text/event-stream", chatChunk("a") + `data: {"error":{"message":"boom"}}` + "\n\n"},
		"anthropic": {"/v1/messages", "text/event-stream", "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n"},
		"gemini":    {"/v1beta/models/g:streamGenerateContent", "text/event-stream", `data: {"error":{"code":500,"message":"x","status":"INTERNAL"}}` + "\n\n"},
		"ollama":    {"/api/chat", "application/x-ndjson", `{"error":"out of memory"}` + "\n"},
		"tgi":       {"/generate_stream", "text/event-stream", `data:{"error":"CUDA OOM","error_type":"generation"}` + "\n\n"},
		"llamacpp":  {"/completion", "text/event-stream", `data: {"error":{"code":500,"message":"x","type":"server_error"}}` + "\n\n"},
		"responses": {"/v1/responses", "text/event-stream", `data: {"type":"response.failed","response":{"status":"failed","error":{"code":"server_error"}}}` + "\n\n"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", c.ctype)
				io.WriteString(w, c.body)
			})
			tp := startProxy(t, up.URL, nil)
			resp, err := http.Post(tp.url+c.path, "application/json", strings.NewReader(`{"stream":true}`))
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if string(b) != c.body {
				t.Fatalf("body changed: %q", b)
			}
			if rec := tp.rec.next(t); rec.Outcome != metrics.OutcomeUpstreamError || rec.Status != 200 {
				t.Fatalf("record: %+v", rec)
			}
		})
	}
}

// A route's configured dialect wins over the path.
func TestRouteDialectOverride(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n"+
			"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\n\n")
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].Dialect = "anthropic" })
	resp, err := http.Post(tp.url+"/custom/chat", "application/json", strings.NewReader(`{"model":"c","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if rec := tp.rec.next(t); rec.Dialect != "anthropic" || rec.OutputTokens != 9 || rec.Events != 1 || rec.Model != "c" {
		t.Fatalf("record: %+v", rec)
	}
}
