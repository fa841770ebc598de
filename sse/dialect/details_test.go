package dialect

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tokentap/tokentap/sse"
)

// fixtureDetails reads a recorded response the way tokentap does: the
// first model named and the last finish reason given.
func fixtureDetails(t *testing.T, name string) (model, finish string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	take := func(data []byte) {
		d := ReadDetails(data, model == "")
		if len(d.Model) > 0 {
			model = string(d.Model)
		}
		if d.Finish != "" {
			finish = d.Finish
		}
	}
	switch {
	case strings.HasSuffix(name, ".sse"):
		p := sse.NewParser(1 << 20)
		p.Feed(b)
		for p.Next() {
			take(p.Event().Data)
		}
	case strings.HasSuffix(name, ".ndjson"):
		for _, l := range bytes.Split(b, []byte("\n")) {
			take(l)
		}
	default:
		take(b)
	}
	return model, finish
}

// The model that answered and why it stopped, read from every dialect's
// recorded responses.
func TestReadDetailsFromFixtures(t *testing.T) {
	for name, want := range map[string][2]string{
		"openai-chat.sse":                 {"llama", "stop"},
		"openai-chat.json":                {"gpt-4o", "stop"},
		"openai-chat-tools.sse":           {"", "tool_calls"},
		"anthropic.sse":                   {"claude-sonnet-4-5", "tool_use"},
		"anthropic.json":                  {"claude", "end_turn"},
		"gemini.sse":                      {"gemini-2.5-flash", "STOP"},
		"ollama-chat.ndjson":              {"llama3.2", "stop"},
		"llamacpp.sse":                    {"gguf", "limit"},
		"vllm-metrics.sse":                {"meta-llama/Llama-3.1-8B-Instruct", "stop"},
		"responses.sse":                   {"", "completed"},
		"openai-chat-reasoning.sse":       {"qwen3", "stop"},
		"llamacpp-openai-timings.sse":     {"gguf", "stop"},
		"ollama-generate-thinking.ndjson": {"qwen3", "stop"},
	} {
		model, finish := fixtureDetails(t, name)
		if finish != want[1] || model != want[0] {
			t.Errorf("%s: model %q finish %q, want %q", name, model, finish, want)
		}
	}
	ev := []byte(`{"model":"m","choices":[{"delta":{},"finish_reason":"stop"}]}`)
	if n := testing.AllocsPerRun(100, func() { ReadDetails(ev, true) }); n != 0 {
		t.Errorf("%v allocations for a common reason", n)
	}
}

// Any input: no panic, a reason no longer than its bound, and a model
// that is a part of the input.
func FuzzReadDetails(f *testing.F) {
	f.Add([]byte(`{"model":"m","choices":[{"finish_reason":"stop"}]}`))
	f.Add([]byte(`{"type":"message_delta","delta":{"stop_reason":"end_turn"}}`))
	f.Add([]byte(`{"response":{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d := ReadDetails(data, true)
		if len(d.Finish) > maxFinish {
			t.Fatalf("reason of %d bytes", len(d.Finish))
		}
		if len(d.Model) > len(data) {
			t.Fatalf("model longer than the data")
		}
	})
}
