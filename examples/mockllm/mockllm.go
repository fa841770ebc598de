// Package mockllm is a simulated OpenAI-compatible inference server with
// realistic timing: a prefill delay that grows with the prompt, then one
// token per decode step with jitter. tokentap's tests, demo and benchmarks
// run against it; cmd/mockllm serves it standalone.
//
//	srv := &http.Server{Handler: mockllm.New(mockllm.Options{})}
//
// It serves POST /v1/chat/completions and /v1/completions (streamed with
// "stream": true, usage in the last chunk with stream_options.include_usage,
// and always in non-streamed bodies) and GET /v1/models.
package mockllm

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// Options set the simulated timing. Zero values take the defaults noted.
type Options struct {
	// PrefillBase is the fixed part of the time to first token (default 20ms).
	PrefillBase time.Duration
	// PrefillPerToken is added per prompt token (default 20µs).
	PrefillPerToken time.Duration
	// TokenGap is the mean decode time per output token (default 10ms).
	TokenGap time.Duration
	// Jitter is the relative spread of each gap, 0…1 (default 0.2).
	Jitter float64
	// MaxTokens is the output length when the request gives no max_tokens
	// (default 32).
	MaxTokens int
	// Model is reported when the request names none (default "mock-llm").
	Model string
}

// Server is the simulated backend, an http.Handler.
type Server struct {
	o      Options
	seq    atomic.Uint64
	active atomic.Int64
}

// New returns a Server with o's timing.
func New(o Options) *Server {
	if o.PrefillBase == 0 {
		o.PrefillBase = 20 * time.Millisecond
	}
	if o.PrefillPerToken == 0 {
		o.PrefillPerToken = 20 * time.Microsecond
	}
	if o.TokenGap == 0 {
		o.TokenGap = 10 * time.Millisecond
	}
	if o.Jitter == 0 {
		o.Jitter = 0.2
	}
	if o.MaxTokens == 0 {
		o.MaxTokens = 32
	}
	if o.Model == "" {
		o.Model = "mock-llm"
	}
	return &Server{o: o}
}

// Active returns the number of requests being served.
func (s *Server) Active() int64 { return s.active.Load() }

type request struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	MaxTokens     int    `json:"max_tokens"`
	MaxCompletion int    `json:"max_completion_tokens"`
	Prompt        any    `json:"prompt"`
	Messages      []struct {
		Content any `json:"content"`
	} `json:"messages"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

var words = strings.Fields("the quick brown fox jumps over a lazy dog while tokens stream out one by one to every user")

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.active.Add(1)
	defer s.active.Add(-1)
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	switch {
	case r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/models"):
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"mockllm"}]}`, s.o.Model)
		return
	case r.Method != http.MethodPost || !(chat || strings.HasSuffix(r.URL.Path, "/completions")):
		http.Error(w, `{"error":{"message":"not found","type":"invalid_request_error"}}`, http.StatusNotFound)
		return
	}
	var req request
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprintf(w, `{"error":{"message":%q,"type":"invalid_request_error"}}`, err.Error())
		return
	}
	if req.Model == "" {
		req.Model = s.o.Model
	}
	n := s.o.MaxTokens
	if req.MaxTokens > 0 {
		n = req.MaxTokens
	}
	if req.MaxCompletion > 0 {
		n = req.MaxCompletion
	}
	promptTokens := estimateTokens(req)
	id := fmt.Sprintf("cmpl-%d", s.seq.Add(1))

	// Prefill.
	if !sleep(r, s.o.PrefillBase+time.Duration(promptTokens)*s.o.PrefillPerToken) {
		return
	}
	if !req.Stream {
		var text strings.Builder
		for i := range n {
			if i > 0 && !sleep(r, s.gap()) {
				return
			}
			text.WriteString(" " + words[i%len(words)])
		}
		w.Header().Set("Content-Type", "application/json")
		usage := fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, promptTokens, n, promptTokens+n)
		if chat {
			fmt.Fprintf(w, `{"id":%q,"object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"length"}],"usage":%s}`,
				id, req.Model, text.String(), usage)
		} else {
			fmt.Fprintf(w, `{"id":%q,"object":"text_completion","model":%q,"choices":[{"index":0,"text":%q,"finish_reason":"length"}],"usage":%s}`,
				id, req.Model, text.String(), usage)
		}
		return
	}

	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	f, _ := w.(http.Flusher)
	send := func(data string) bool {
		if _, err := fmt.Fprintf(w, "data: %s\n\n", data); err != nil {
			return false
		}
		if f != nil {
			f.Flush()
		}
		return true
	}
	if chat && !send(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`, id, req.Model)) {
		return
	}
	for i := range n {
		if i > 0 && !sleep(r, s.gap()) {
			return
		}
		word := " " + words[i%len(words)]
		var chunk string
		if chat {
			chunk = fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{"content":%q},"finish_reason":null}]}`, id, req.Model, word)
		} else {
			chunk = fmt.Sprintf(`{"id":%q,"object":"text_completion","model":%q,"choices":[{"index":0,"text":%q,"finish_reason":null}]}`, id, req.Model, word)
		}
		if !send(chunk) {
			return
		}
	}
	if chat {
		send(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`, id, req.Model))
	}
	if req.StreamOptions.IncludeUsage {
		send(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
			id, req.Model, promptTokens, n, promptTokens+n))
	}
	send("[DONE]")
}

// gap is one decode step: TokenGap ± Jitter.
func (s *Server) gap() time.Duration {
	j := 1 + s.o.Jitter*(2*rand.Float64()-1)
	return time.Duration(float64(s.o.TokenGap) * j)
}

// sleep waits d unless the client goes away first.
func sleep(r *http.Request, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// estimateTokens is a tokenizer-free estimate: about 4 bytes per token.
func estimateTokens(req request) int {
	n := len(fmt.Sprint(req.Prompt))
	for _, m := range req.Messages {
		n += len(fmt.Sprint(m.Content))
	}
	return max(1, n/4)
}
