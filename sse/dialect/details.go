package dialect

import (
	"bytes"
	"strings"

	"github.com/tidwall/gjson"
)

// Details are what an event or body says about the response beyond its
// tokens: the model that answered and why the generation ended. Tracing
// reads them (the span's gen_ai.response.model and
// gen_ai.response.finish_reasons); the measurements never need them.
type Details struct {
	// Model aliases the data it was read from ("" when it names none).
	Model []byte
	// Finish is the reason as the API wrote it, interned for the common
	// ones; "" when the data gives none.
	Finish string
}

// modelPaths are where the APIs name the model that answered: OpenAI,
// TGI's and Ollama's top level, Anthropic's message_start, the Responses
// API's response object, Gemini's modelVersion.
var modelPaths = []string{"model", "message.model", "response.model", "modelVersion"}

// finishPaths are where the APIs say why the generation ended: OpenAI's
// choices, Anthropic's message_delta and message body, Ollama, Gemini,
// TGI, llama.cpp's native API, the Responses API.
var finishPaths = []string{
	"choices.0.finish_reason", "delta.stop_reason", "stop_reason", "done_reason",
	"candidates.0.finishReason", "details.finish_reason", "stop_type",
	"response.incomplete_details.reason", "response.status",
}

// finishKeys are the member names of finishPaths' last elements: data
// holding none of them is not looked into.
var finishKeys = [][]byte{[]byte("finish"), []byte("stop_"), []byte("done_reason"), []byte("Reason"), []byte(`"status"`), []byte(`"reason"`)}

// ReadDetails reads the model (when wantModel) and the finish reason of an
// event, NDJSON line or body of any dialect. It allocates only for a
// finish reason outside the common ones.
func ReadDetails(data []byte, wantModel bool) Details {
	var d Details
	s := object(data)
	if s == "" {
		return d
	}
	if wantModel {
		for _, p := range modelPaths {
			if v := gjson.Get(s, p); nonEmptyString(v) {
				d.Model = stringView(data, v)
				break
			}
		}
	}
	for _, k := range finishKeys {
		if bytes.Contains(data, k) {
			d.Finish = finishIn(s)
			break
		}
	}
	return d
}

func finishIn(s string) string {
	for _, p := range finishPaths {
		v := gjson.Get(s, p)
		if !nonEmptyString(v) {
			continue
		}
		if p == "response.status" && (v.Str == "in_progress" || v.Str == "queued") {
			continue
		}
		if p == "stop_type" && v.Str == "none" {
			continue
		}
		return internFinish(v.Str)
	}
	return ""
}

// commonFinish are the reasons the supported APIs write, interned so a
// record keeps no reference to the body and costs no allocation.
var commonFinish = []string{
	"stop", "length", "tool_calls", "content_filter", "function_call", "end_turn", "max_tokens",
	"stop_sequence", "tool_use", "pause_turn", "refusal", "eos_token", "eos", "limit", "word",
	"STOP", "MAX_TOKENS", "SAFETY", "RECITATION", "OTHER", "completed", "incomplete", "failed",
	"max_output_tokens", "load", "unload",
}

// maxFinish bounds a reason copied from the data.
const maxFinish = 64

func internFinish(v string) string {
	for _, c := range commonFinish {
		if v == c {
			return c
		}
	}
	if len(v) > maxFinish {
		v = v[:maxFinish]
	}
	return strings.Clone(v)
}
