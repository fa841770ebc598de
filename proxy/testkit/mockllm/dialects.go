package mockllm

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

type openAIChat struct{}

func (openAIChat) contentType(*call) string { return "text/event-stream" }

func (openAIChat) start(c *call) string {
	return sseData(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`, c.id, c.model))
}

func (openAIChat) token(c *call, _ int, reasoning bool, text string) string {
	field := "content"
	if reasoning {
		field = "reasoning_content"
	}
	stamp := ""
	if c.s.o.Stamp {
		stamp = fmt.Sprintf(`,"mock_sent":%d`, time.Now().UnixNano())
	}
	return sseData(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{%q:%q},"finish_reason":null}]%s}`, c.id, c.model, field, text, stamp))
}

func (openAIChat) end(c *call) string {
	s := sseData(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`, c.id, c.model))
	return s + openAIUsageChunk(c) + sseData("[DONE]")
}

func openAIUsageChunk(c *call) string {
	if !strings.Contains(strings.ReplaceAll(c.body, " ", ""), `"include_usage":true`) {
		return ""
	}
	return sseData(fmt.Sprintf(`{"id":%q,"object":"chat.completion.chunk","model":%q,"choices":[],"usage":%s}`, c.id, c.model, openAIUsage(c)))
}

// openAIUsage is the usage object; with a prefix cache, the prompt's
// cached tokens too (prompt_tokens_details.cached_tokens, as OpenAI and
// vLLM report them).
func openAIUsage(c *call) string {
	details := ""
	if c.s.o.PrefixCache {
		details = fmt.Sprintf(`,"prompt_tokens_details":{"cached_tokens":%d}`, c.cached)
	}
	return fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d%s}`, c.prompt, c.output(), c.prompt+c.output(), details)
}

func (openAIChat) body(c *call, text, thinking string) string {
	r := ""
	if thinking != "" {
		r = fmt.Sprintf(`,"reasoning_content":%q`, thinking)
	}
	return fmt.Sprintf(`{"id":%q,"object":"chat.completion","model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q%s},"finish_reason":"length"}],"usage":%s}`,
		c.id, c.model, text, r, openAIUsage(c))
}

type openAICompletions struct{}

func (openAICompletions) contentType(*call) string { return "text/event-stream" }
func (openAICompletions) start(*call) string       { return "" }

func (openAICompletions) token(c *call, _ int, _ bool, text string) string {
	return sseData(fmt.Sprintf(`{"id":%q,"object":"text_completion","model":%q,"choices":[{"index":0,"text":%q,"finish_reason":null}]}`, c.id, c.model, text))
}

func (openAICompletions) end(c *call) string { return openAIUsageChunk(c) + sseData("[DONE]") }

func (openAICompletions) body(c *call, text, _ string) string {
	return fmt.Sprintf(`{"id":%q,"object":"text_completion","model":%q,"choices":[{"index":0,"text":%q,"finish_reason":"length"}],"usage":%s}`,
		c.id, c.model, text, openAIUsage(c))
}

type responses struct{}

func (responses) contentType(*call) string { return "text/event-stream" }

func (responses) start(c *call) string {
	return sseEvent("response.created", fmt.Sprintf(`{"type":"response.created","sequence_number":0,"response":{"id":%q,"object":"response","status":"in_progress","model":%q,"output":[]}}`, c.id, c.model)) +
		sseEvent("response.output_item.added", `{"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"msg_1","type":"message","role":"assistant","content":[]}}`)
}

func (responses) token(c *call, i int, reasoning bool, text string) string {
	typ := "response.output_text.delta"
	if reasoning {
		typ = "response.reasoning_summary_text.delta"
	}
	return sseEvent(typ, fmt.Sprintf(`{"type":%q,"sequence_number":%d,"item_id":"msg_1","output_index":0,"content_index":0,"delta":%q}`, typ, i+2, text))
}

func (responses) end(c *call) string {
	return sseEvent("response.completed", fmt.Sprintf(`{"type":"response.completed","sequence_number":%d,"response":{"id":%q,"object":"response","status":"completed","model":%q,"usage":{"input_tokens":%d,"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":%d},"total_tokens":%d}}}`,
		c.output()+2, c.id, c.model, c.prompt, c.output(), c.reasoning, c.prompt+c.output()))
}

func (responses) body(c *call, text, _ string) string {
	return fmt.Sprintf(`{"id":%q,"object":"response","status":"completed","error":null,"model":%q,"output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":%q}]}],"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d}}`,
		c.id, c.model, text, c.prompt, c.output(), c.prompt+c.output())
}

type anthropic struct{}

func (anthropic) contentType(*call) string { return "text/event-stream" }

func (anthropic) start(c *call) string {
	s := sseEvent("message_start", fmt.Sprintf(`{"type":"message_start","message":{"id":%q,"type":"message","role":"assistant","content":[],"model":%q,"stop_reason":null,"usage":{"input_tokens":%d,"output_tokens":1}}}`, c.id, c.model, c.prompt))
	if c.reasoning > 0 {
		return s + sseEvent("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}`)
	}
	return s + sseEvent("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`) + sseEvent("ping", `{"type": "ping"}`)
}

func (anthropic) token(c *call, i int, reasoning bool, text string) string {
	if reasoning {
		return sseEvent("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":%q}}`, text))
	}
	s := ""
	idx := 0
	if c.reasoning > 0 {
		idx = 1
		if i == c.reasoning {
			s = sseEvent("content_block_stop", `{"type":"content_block_stop","index":0}`) +
				sseEvent("content_block_start", `{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}`)
		}
	}
	return s + sseEvent("content_block_delta", fmt.Sprintf(`{"type":"content_block_delta","index":%d,"delta":{"type":"text_delta","text":%q}}`, idx, text))
}

func (anthropic) end(c *call) string {
	idx := 0
	if c.reasoning > 0 {
		idx = 1
	}
	return sseEvent("content_block_stop", fmt.Sprintf(`{"type":"content_block_stop","index":%d}`, idx)) +
		sseEvent("message_delta", fmt.Sprintf(`{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"output_tokens":%d}}`, c.output())) +
		sseEvent("message_stop", `{"type":"message_stop"}`)
}

func (anthropic) body(c *call, text, thinking string) string {
	content := fmt.Sprintf(`{"type":"text","text":%q}`, text)
	if thinking != "" {
		content = fmt.Sprintf(`{"type":"thinking","thinking":%q,"signature":"c2ln"},`, thinking) + content
	}
	return fmt.Sprintf(`{"id":%q,"type":"message","role":"assistant","model":%q,"content":[%s],"stop_reason":"max_tokens","usage":{"input_tokens":%d,"output_tokens":%d}}`,
		c.id, c.model, content, c.prompt, c.output())
}

type gemini struct{ sse bool }

func (g gemini) contentType(*call) string {
	if g.sse {
		return "text/event-stream"
	}
	return "application/json"
}

func (g gemini) start(*call) string {
	if g.sse {
		return ""
	}
	return "["
}

func geminiChunk(c *call, i int, reasoning bool, text string, done bool) string {
	thought := ""
	if reasoning {
		thought = `,"thought":true`
	}
	finish := ""
	if done {
		finish = `,"finishReason":"MAX_TOKENS"`
	}
	answer := max(0, i+1-c.reasoning)
	return fmt.Sprintf(`{"candidates":[{"content":{"parts":[{"text":%q%s}],"role":"model"}%s,"index":0}],"usageMetadata":{"promptTokenCount":%d,"candidatesTokenCount":%d,"thoughtsTokenCount":%d,"totalTokenCount":%d},"modelVersion":%q}`,
		text, thought, finish, c.prompt, answer, min(i+1, c.reasoning), c.prompt+i+1, c.model)
}

func (g gemini) token(c *call, i int, reasoning bool, text string) string {
	chunk := geminiChunk(c, i, reasoning, text, i == c.output()-1)
	if g.sse {
		return sseData(chunk)
	}
	if i > 0 {
		return ",\r\n" + chunk
	}
	return chunk
}

func (g gemini) end(*call) string {
	if g.sse {
		return ""
	}
	return "]"
}

func (gemini) body(c *call, text, _ string) string {
	return geminiChunk(c, c.output()-1, false, text, true)
}

type ollama struct{ chat bool }

func (ollama) contentType(*call) string { return "application/x-ndjson" }
func (ollama) start(*call) string       { return "" }

func (o ollama) line(c *call, content, thinking string, done bool) string {
	created := `"created_at":"2025-01-01T00:00:00Z"`
	var msg string
	if o.chat {
		th := ""
		if thinking != "" {
			th = fmt.Sprintf(`,"thinking":%q`, thinking)
		}
		msg = fmt.Sprintf(`"message":{"role":"assistant","content":%q%s}`, content, th)
	} else {
		msg = fmt.Sprintf(`"response":%q`, content)
		if thinking != "" {
			msg += fmt.Sprintf(`,"thinking":%q`, thinking)
		}
	}
	if !done {
		return fmt.Sprintf(`{"model":%q,%s,%s,"done":false}`, c.model, created, msg) + "\n"
	}
	total := time.Since(c.start)
	return fmt.Sprintf(`{"model":%q,%s,%s,"done":true,"done_reason":"length","total_duration":%d,"load_duration":%d,"prompt_eval_count":%d,"prompt_eval_duration":%d,"eval_count":%d,"eval_duration":%d}`,
		c.model, created, msg, total.Nanoseconds(), 1000000, c.prompt, c.prefill.Nanoseconds(), c.output(), c.decode.Nanoseconds()) + "\n"
}

func (o ollama) token(c *call, _ int, reasoning bool, text string) string {
	if reasoning {
		return o.line(c, "", text, false)
	}
	return o.line(c, text, "", false)
}

func (o ollama) end(c *call) string { return o.line(c, "", "", true) }

func (o ollama) body(c *call, text, thinking string) string { return o.line(c, text, thinking, true) }

type tgi struct{}

func (tgi) contentType(*call) string { return "text/event-stream" }
func (tgi) start(*call) string       { return "" }

func (tgi) token(c *call, i int, _ bool, text string) string {
	return "data:" + fmt.Sprintf(`{"index":%d,"token":{"id":%d,"text":%q,"logprob":-0.1,"special":false},"generated_text":null,"details":null}`, i+1, 100+i, text) + "\n\n"
}

func (tgi) end(c *call) string {
	return "data:" + fmt.Sprintf(`{"index":%d,"token":{"id":2,"text":"</s>","logprob":-0.01,"special":true},"generated_text":"","details":{"finish_reason":"length","generated_tokens":%d,"seed":null}}`, c.output()+1, c.output()) + "\n\n"
}

func (tgi) body(c *call, text, _ string) string {
	return fmt.Sprintf(`{"generated_text":%q,"details":{"finish_reason":"length","generated_tokens":%d,"seed":null}}`, text, c.output())
}

// headers sets the timing headers TGI sends on /generate.
func (tgi) headers(c *call) {
	h := c.w.Header()
	h.Set("x-compute-type", "mock")
	h.Set("x-queue-time", "0")
	h.Set("x-inference-time", strconv.FormatInt((c.prefill+c.decode).Milliseconds(), 10))
	h.Set("x-time-per-token", strconv.FormatInt(c.decode.Milliseconds()/int64(max(1, c.output())), 10))
}

var _ http.Handler = (*Server)(nil)

type llamaCpp struct{}

func (llamaCpp) contentType(*call) string { return "text/event-stream" }
func (llamaCpp) start(*call) string       { return "" }

func (llamaCpp) token(c *call, i int, _ bool, text string) string {
	return sseData(fmt.Sprintf(`{"content":%q,"stop":false,"id_slot":0,"index":0}`, text))
}

func llamaTail(c *call) string {
	return fmt.Sprintf(`"tokens_predicted":%d,"tokens_evaluated":%d,"timings":{"prompt_n":%d,"prompt_ms":%.3f,"predicted_n":%d,"predicted_ms":%.3f}`,
		c.output(), c.prompt, c.prompt, ms(c.prefill), c.output(), ms(c.decode))
}

func (llamaCpp) end(c *call) string {
	return sseData(fmt.Sprintf(`{"content":"","stop":true,"id_slot":0,"model":%q,%s}`, c.model, llamaTail(c)))
}

func (llamaCpp) body(c *call, text, _ string) string {
	return fmt.Sprintf(`{"content":%q,"stop":true,"id_slot":0,"model":%q,%s}`, text, c.model, llamaTail(c))
}
