package main

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
)

// workload is one kind of request of the mix.
type workload struct {
	Name        string
	PromptBytes int // about 4 bytes per token
	MaxTokens   int
}

// The workloads of the request mix and of the matrix.
var workloads = map[string]workload{
	"chat":   {Name: "chat", PromptBytes: 400, MaxTokens: 128},    // short chat
	"doc":    {Name: "doc", PromptBytes: 12000, MaxTokens: 32},    // long document, short answer
	"gen":    {Name: "gen", PromptBytes: 200, MaxTokens: 512},     // long output
	"tiny":   {Name: "tiny", PromptBytes: 16, MaxTokens: 1},       // small requests, for request rates
	"stream": {Name: "stream", PromptBytes: 100, MaxTokens: 64},   // steady streams, for delivery delay
	"idle":   {Name: "idle", PromptBytes: 16, MaxTokens: 1 << 20}, // never-ending streams, for memory
}

var words = strings.Fields("the quick brown fox jumps over a lazy dog while tokens stream out one by one to every user of the fleet")

// promptText makes n bytes of text. With a shared prefix, every request
// starts the same (a system prompt a prefix cache can reuse) and differs
// only at its end; otherwise a random token leads, so no prefix repeats.
func promptText(n int, shared bool, r *rand.Rand) string {
	var b strings.Builder
	if !shared {
		fmt.Fprintf(&b, "[%016x] ", r.Uint64())
	}
	for i := 0; b.Len() < n-24; i++ {
		b.WriteString(words[i%len(words)])
		b.WriteByte(' ')
	}
	fmt.Fprintf(&b, "q%016x", r.Uint64())
	return b.String()
}

// body builds an OpenAI chat completions request.
func body(w workload, model string, stream, sharedPrefix bool, r *rand.Rand) []byte {
	req := map[string]any{
		"model":      model,
		"max_tokens": w.MaxTokens,
		"messages":   []map[string]string{{"role": "user", "content": promptText(w.PromptBytes, sharedPrefix, r)}},
	}
	if stream {
		req["stream"] = true
		req["stream_options"] = map[string]bool{"include_usage": true}
	}
	b, _ := json.Marshal(req)
	return b
}

// mix parses a comma-separated list of workload names.
func mix(spec string) ([]workload, error) {
	var out []workload
	for _, name := range strings.Split(spec, ",") {
		if name == "mixed" {
			out = append(out, workloads["chat"], workloads["doc"], workloads["gen"])
			continue
		}
		w, ok := workloads[strings.TrimSpace(name)]
		if !ok {
			return nil, fmt.Errorf("-workload: unknown %q (chat, doc, gen, mixed, tiny, stream)", name)
		}
		out = append(out, w)
	}
	return out, nil
}
