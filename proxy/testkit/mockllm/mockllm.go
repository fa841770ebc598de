// Package mockllm is a simulated inference server with realistic timing: a
// prefill delay that grows with the prompt, then one token per decode step
// with jitter, optionally reasoning tokens before the answer. It speaks the
// streaming dialects tokentap reads, chosen by path:
//
//	POST /v1/chat/completions, /v1/completions   OpenAI (SSE with "stream": true)
//	POST /v1/responses                           OpenAI Responses
//	POST /v1/embeddings                          OpenAI embeddings
//	POST /v1/messages                            Anthropic Messages
//	POST /v1beta/models/M:generateContent        Gemini (and :streamGenerateContent, ?alt=sse for SSE)
//	POST /api/chat, /api/generate                Ollama (NDJSON unless "stream": false)
//	POST /generate, /generate_stream             TGI
//	POST /completion                             llama.cpp
//	GET  /v1/models
//
// Usage is reported as each API does (for OpenAI streams only with
// stream_options.include_usage), with server timings where the API has them.
// A request may set "mock_reasoning_tokens": N to get N reasoning tokens
// before the answer, and "mock_hold_ms": N to stay silent N ms after the
// first token (an open, idle stream), or "mock_hold": true to stay silent
// after it until Options.Hold is closed. A path that starts with
// /_mock/PREFILL/GAP/ (Go durations: /_mock/20ms/0s/v1/chat/completions)
// sets the prefill and the token gap of that request, for a client or a
// gateway that can choose the path but not the body's fields (a gateway's
// custom host). tokentap's tests, demo and benchmarks run against it;
// cmd/mockllm serves it standalone.
//
//	srv := &http.Server{Handler: mockllm.New(mockllm.Options{})}
package mockllm

import (
	"container/list"
	"fmt"
	"hash"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tidwall/gjson"
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
	// MaxTokens is the output length when the request gives none (default 32).
	MaxTokens int
	// Model is reported when the request names none (default "mock-llm").
	Model string
	// BatchSlowdown models continuous batching: with n requests being
	// served, each decode step takes TokenGap × (1 + BatchSlowdown×(n−1)) and
	// a prefill PrefillBase+prompt cost × (1 + BatchSlowdown×n). More
	// concurrency buys throughput with per-user latency, as on real servers.
	// 0 turns it off.
	BatchSlowdown float64
	// Slots bounds the requests served at once, as a server's batch does
	// (vLLM's max_num_seqs, llama.cpp's slots): past it requests wait,
	// in the order they came, before their prefill starts (their wait is
	// part of their time to first token), and the batch slowdown counts
	// the requests being served. 0: no bound.
	Slots int
	// PrefixCache models prefix caching: prompt bytes in 512-byte blocks
	// that start the same as an earlier request's cost no prefill.
	PrefixCache bool
	// PrefixCachePrompts bounds the prefix cache to this many prompts
	// (told apart by their first block), the least recently used evicted
	// first, as a server's KV cache holds a few prompts' blocks. 0: no
	// bound.
	PrefixCachePrompts int
	// Stamp adds "mock_sent" (Unix nanoseconds) to every streamed OpenAI
	// chunk, so a client on the same machine can measure each token's
	// delivery delay.
	Stamp bool
	// FlushEvery > 1 flushes a stream only every FlushEvery writes (and at
	// its end): a buffering hop between the server and its clients, whose
	// tokens then arrive in bursts.
	FlushEvery int
	// Hold, closed by the caller, ends the silence of requests that set
	// "mock_hold": true (a stream held open for as long as a test needs,
	// whatever the machine's speed).
	Hold <-chan struct{}
}

// Server is the simulated backend, an http.Handler.
type Server struct {
	o      Options
	seq    atomic.Uint64
	active atomic.Int64
	// slots holds a token per request being served (Options.Slots);
	// serving counts them. slowdown is SetSlowdown's factor (float64 bits).
	slots    chan struct{}
	serving  atomic.Int64
	slowdown atomic.Uint64

	cacheMu sync.Mutex
	cache   map[uint64]struct{} // hashes of cached prompt prefixes
	prompts *list.List          // with PrefixCachePrompts: *cachedPrompt, most recent first
	byFirst map[uint64]*list.Element
}

// cachedPrompt is one prompt in a bounded prefix cache: its blocks' hashes.
type cachedPrompt struct {
	first  uint64
	blocks map[uint64]struct{}
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
	s := &Server{o: o}
	if o.Slots > 0 {
		s.slots = make(chan struct{}, o.Slots)
	}
	s.slowdown.Store(math.Float64bits(1))
	return s
}

// SetSlowdown makes every prefill and decode step f times as long from now
// on (1: as configured): a backend that slows down (a noisy neighbour, a
// throttled GPU) and recovers.
func (s *Server) SetSlowdown(f float64) { s.slowdown.Store(math.Float64bits(f)) }

func (s *Server) slow(d time.Duration) time.Duration {
	return time.Duration(float64(d) * math.Float64frombits(s.slowdown.Load()))
}

// batch is the number of requests in the batch: those being served (with
// Slots), else those being answered.
func (s *Server) batch() int64 {
	if s.slots != nil {
		return s.serving.Load()
	}
	return s.active.Load()
}

// take waits for a slot (Options.Slots), in arrival order, unless the
// client goes away first; release gives it back.
func (c *call) take() bool {
	s := c.s
	if s.slots == nil {
		return true
	}
	select {
	case s.slots <- struct{}{}:
		s.serving.Add(1)
		return true
	case <-c.r.Context().Done():
		return false
	}
}

func (c *call) release() {
	if s := c.s; s.slots != nil {
		s.serving.Add(-1)
		<-s.slots
	}
}

// metrics answers /metrics as vLLM names its own: the requests being
// served (in a slot) and those waiting for one.
func (s *Server) metrics(w http.ResponseWriter) {
	running, all := s.batch(), s.active.Load()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	fmt.Fprintf(w, "# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\n")
	fmt.Fprintf(w, "vllm:num_requests_running{model_name=%q} %d\n", s.o.Model, running)
	fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=%q} %d\n", s.o.Model, max(0, all-running))
}

// Active returns the number of requests being served.
func (s *Server) Active() int64 { return s.active.Load() }

// call is one request being answered.
type call struct {
	s      *Server
	w      http.ResponseWriter
	r      *http.Request
	body   string
	id     string
	model  string
	stream bool
	prompt int           // prompt tokens (estimated)
	cached int           // of which found in the prefix cache
	hold   time.Duration // silence after the first token (an idle stream)
	// prefillBase and tokenGap are the server's, or the request's from
	// its /_mock/PREFILL/GAP/ path.
	prefillBase, tokenGap time.Duration
	gated                 bool // silence after the first token until Options.Hold closes
	reasoning             int  // reasoning tokens before the answer
	answer                int  // answer tokens
	start                 time.Time
	prefill               time.Duration
	decode                time.Duration
	writes                int
}

var words = strings.Fields("the quick brown fox jumps over a lazy dog while tokens stream out one by one to every user")

func word(i int) string { return " " + words[i%len(words)] }

// maxTokensPaths are where each API puts the output limit.
var maxTokensPaths = []string{"max_tokens", "max_completion_tokens", "max_output_tokens",
	"generationConfig.maxOutputTokens", "options.num_predict", "parameters.max_new_tokens", "n_predict"}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && r.URL.Path == "/metrics" {
		s.metrics(w)
		return
	}
	s.active.Add(1)
	defer s.active.Add(-1)
	path := r.URL.Path
	prefillBase, tokenGap := s.o.PrefillBase, s.o.TokenGap
	if rest, ok := strings.CutPrefix(path, "/_mock/"); ok {
		parts := strings.SplitN(rest, "/", 3)
		var err1, err2 error
		if len(parts) == 3 {
			prefillBase, err1 = time.ParseDuration(parts[0])
			tokenGap, err2 = time.ParseDuration(parts[1])
		}
		if len(parts) < 3 || err1 != nil || err2 != nil || prefillBase < 0 || tokenGap < 0 {
			http.Error(w, `{"error":{"message":"/_mock/PREFILL/GAP/ wants two durations","type":"invalid_request_error"}}`, http.StatusBadRequest)
			return
		}
		path = "/" + parts[2]
	}
	if r.Method == http.MethodGet && strings.HasSuffix(path, "/models") {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"mockllm"}]}`, s.o.Model)
		return
	}
	raw, err := io.ReadAll(r.Body)
	if r.Method != http.MethodPost || err != nil {
		http.Error(w, `{"error":{"message":"POST a JSON body","type":"invalid_request_error"}}`, http.StatusBadRequest)
		return
	}
	body := string(raw)
	if body != "" && !gjson.Valid(body) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, `{"error":{"message":"invalid JSON","type":"invalid_request_error"}}`)
		return
	}
	c := &call{s: s, w: w, r: r, body: body, id: fmt.Sprintf("mock-%d", s.seq.Add(1)), start: time.Now(),
		prefillBase: prefillBase, tokenGap: tokenGap}
	c.model = gjson.Get(body, "model").Str
	c.answer = s.o.MaxTokens
	for _, p := range maxTokensPaths {
		if v := gjson.Get(body, p); v.Int() > 0 {
			c.answer = int(v.Int())
			break
		}
	}
	c.reasoning = int(gjson.Get(body, "mock_reasoning_tokens").Int())
	c.hold = time.Duration(gjson.Get(body, "mock_hold_ms").Int()) * time.Millisecond
	c.gated = gjson.Get(body, "mock_hold").Bool()
	c.prompt = max(1, len(body)/4)
	c.cached = s.cachedPrefix(raw) / 4
	c.stream = gjson.Get(body, "stream").Bool()

	c.route(path)
}

// route serves the call by the API its path names (404 for none).
func (c *call) route(path string) {
	s, w, r, body := c.s, c.w, c.r, c.body
	var d dialect
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		d = openAIChat{}
	case strings.HasSuffix(path, "/completions"):
		d = openAICompletions{}
	case strings.HasSuffix(path, "/responses"):
		d = responses{}
	case strings.HasSuffix(path, "/embeddings"):
		c.serveEmbeddings()
		return
	case strings.HasSuffix(path, "/messages"):
		d = anthropic{}
	case strings.Contains(path, ":generateContent"), strings.Contains(path, ":streamGenerateContent"):
		c.stream = strings.Contains(path, ":streamGenerateContent")
		if i := strings.Index(path, "/models/"); i >= 0 {
			c.model, _, _ = strings.Cut(path[i+len("/models/"):], ":")
		}
		d = gemini{sse: r.URL.Query().Get("alt") == "sse"}
	case strings.HasSuffix(path, "/api/chat"), strings.HasSuffix(path, "/api/generate"):
		if v := gjson.Get(body, "stream"); !v.Exists() {
			c.stream = true // Ollama streams by default
		}
		d = ollama{chat: strings.HasSuffix(path, "/api/chat")}
	case strings.HasSuffix(path, "/generate_stream"), strings.HasSuffix(path, "/generate"):
		c.stream = strings.HasSuffix(path, "/generate_stream")
		d = tgi{}
	case strings.HasSuffix(path, "/completion"):
		d = llamaCpp{}
	default:
		http.Error(w, `{"error":{"message":"not found","type":"invalid_request_error"}}`, http.StatusNotFound)
		return
	}
	if c.model == "" {
		c.model = s.o.Model
	}
	c.serve(d)
}

// dialect writes one API's framing of the simulated generation.
type dialect interface {
	contentType(c *call) string
	// start is written before the first token; token for each token;
	// end after the last one. body is the whole non-streamed answer.
	start(c *call) string
	token(c *call, i int, reasoning bool, text string) string
	end(c *call) string
	body(c *call, text, thinking string) string
}

func (c *call) serve(d dialect) {
	s := c.s
	if !c.take() {
		return
	}
	defer c.release()
	prefill := c.prefillBase + time.Duration(c.prompt-c.cached)*s.o.PrefillPerToken
	prefill = s.slow(time.Duration(float64(prefill) * (1 + s.o.BatchSlowdown*float64(s.batch()))))
	if !c.sleep(prefill) {
		return
	}
	c.prefill = time.Since(c.start)
	decodeStart := time.Now()
	total := c.reasoning + c.answer
	if !c.stream {
		var text, thinking strings.Builder
		for i := range total {
			if i > 0 && !c.sleep(s.gap(c.tokenGap)) {
				return
			}
			if i < c.reasoning {
				thinking.WriteString(word(i))
			} else {
				text.WriteString(word(i))
			}
		}
		c.decode = time.Since(decodeStart)
		c.w.Header().Set("Content-Type", "application/json")
		if t, ok := d.(tgi); ok {
			t.headers(c)
		}
		io.WriteString(c.w, d.body(c, text.String(), thinking.String()))
		return
	}
	c.w.Header().Set("Content-Type", d.contentType(c))
	c.w.Header().Set("Cache-Control", "no-cache")
	if !c.send(d.start(c)) {
		return
	}
	for i := range total {
		if i > 0 && !c.sleep(s.gap(c.tokenGap)) {
			return
		}
		if !c.send(d.token(c, i, i < c.reasoning, word(i))) {
			return
		}
		if i == 0 && c.hold > 0 && !c.sleep(c.hold) {
			return
		}
		if i == 0 && c.gated && !c.wait(s.o.Hold) {
			return
		}
	}
	c.decode = time.Since(decodeStart)
	c.send(d.end(c))
}

func (c *call) send(s string) bool {
	if s == "" {
		return true
	}
	if _, err := io.WriteString(c.w, s); err != nil {
		return false
	}
	if c.writes++; c.s.o.FlushEvery > 1 && c.writes%c.s.o.FlushEvery != 0 {
		return true // held back; net/http flushes what is left when the handler returns
	}
	if f, ok := c.w.(http.Flusher); ok {
		f.Flush()
	}
	return true
}

// gap is one decode step: TokenGap ± Jitter, slowed by the batch.
func (s *Server) gap(mean time.Duration) time.Duration {
	j := 1 + s.o.Jitter*(2*rand.Float64()-1)
	batch := 1 + s.o.BatchSlowdown*float64(max(0, s.batch()-1))
	return s.slow(time.Duration(float64(mean) * j * batch))
}

// cachedPrefix returns how many leading bytes of body, in whole 512-byte
// blocks, an earlier request already had, and remembers body's blocks.
func (s *Server) cachedPrefix(body []byte) int {
	if !s.o.PrefixCache {
		return 0
	}
	const block = 512
	s.cacheMu.Lock()
	defer s.cacheMu.Unlock()
	if s.o.PrefixCachePrompts > 0 {
		return s.cachedPrompt(body, block)
	}
	if s.cache == nil || len(s.cache) > 1<<20 {
		s.cache = map[uint64]struct{}{}
	}
	return matchBlocks(fnv.New64a(), body, block, s.cache)
}

// matchBlocks hashes body's whole blocks, each hash covering the body up
// to its block's end, into seen, and returns how many bytes of body were
// there before: the blocks seen in a row from the start.
func matchBlocks(h hash.Hash64, body []byte, block int, seen map[uint64]struct{}) int {
	cached, hit := 0, true
	for off := 0; off+block <= len(body); off += block {
		h.Write(body[off : off+block])
		sum := h.Sum64()
		if _, ok := seen[sum]; ok && hit {
			cached = off + block
		} else {
			hit = false
			seen[sum] = struct{}{}
		}
	}
	return cached
}

// cachedPrompt is cachedPrefix with the cache bounded to
// PrefixCachePrompts prompts.
func (s *Server) cachedPrompt(body []byte, block int) int {
	if len(body) < block {
		return 0
	}
	if s.prompts == nil {
		s.prompts, s.byFirst = list.New(), map[uint64]*list.Element{}
	}
	h := fnv.New64a()
	h.Write(body[:block])
	first := h.Sum64()
	e, ok := s.byFirst[first]
	if ok {
		s.prompts.MoveToFront(e)
	} else {
		e = s.prompts.PushFront(&cachedPrompt{first: first, blocks: map[uint64]struct{}{}})
		s.byFirst[first] = e
		if s.prompts.Len() > s.o.PrefixCachePrompts {
			old := s.prompts.Remove(s.prompts.Back()).(*cachedPrompt)
			delete(s.byFirst, old.first)
		}
	}
	h.Reset()
	return matchBlocks(h, body, block, e.Value.(*cachedPrompt).blocks)
}

// sleep waits d unless the client goes away first.
func (c *call) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-c.r.Context().Done():
		return false
	}
}

// wait waits for hold to close (nil: at once); false if the client left.
func (c *call) wait(hold <-chan struct{}) bool {
	if hold == nil {
		return true
	}
	select {
	case <-hold:
		return true
	case <-c.r.Context().Done():
		return false
	}
}

func (c *call) output() int { return c.reasoning + c.answer }

func (c *call) serveEmbeddings() {
	in := gjson.Get(c.body, "input")
	n := 1
	if in.IsArray() && gjson.Get(in.Raw, "0").Type != gjson.Number {
		n = int(gjson.Get(in.Raw, "#").Int())
	}
	if !c.sleep(c.prefillBase + time.Duration(c.prompt)*c.s.o.PrefillPerToken) {
		return
	}
	var b strings.Builder
	b.WriteString(`{"object":"list","data":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"object":"embedding","index":%d,"embedding":[0.%d,-0.25,0.5,0.125]}`, i, i%10)
	}
	if c.model == "" {
		c.model = c.s.o.Model
	}
	fmt.Fprintf(&b, `],"model":%q,"usage":{"prompt_tokens":%d,"total_tokens":%d}}`, c.model, c.prompt, c.prompt)
	c.w.Header().Set("Content-Type", "application/json")
	io.WriteString(c.w, b.String())
}

func sseData(data string) string { return "data: " + data + "\n\n" }

func sseEvent(name, data string) string { return "event: " + name + "\ndata: " + data + "\n\n" }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
