package dialect

import (
	"bytes"
	"encoding/json"
	"math"
	"testing"
)

// referenceOpenAI applies the documented OpenAI predicates to a document
// decoded by encoding/json: the slow, obvious reading that the gjson one
// must agree with.
func referenceOpenAI(data []byte) (o Obs, ok bool) {
	var doc map[string]any
	if json.Unmarshal(data, &doc) != nil {
		return o, false
	}
	nonEmptyStr := func(v any) bool { s, ok := v.(string); return ok && s != "" }
	if choices, isArr := doc["choices"].([]any); isArr {
		for _, c := range choices {
			cm, _ := c.(map[string]any)
			delta, _ := cm["delta"].(map[string]any)
			calls, _ := delta["tool_calls"].([]any)
			if nonEmptyStr(delta["content"]) || nonEmptyStr(cm["text"]) || len(calls) > 0 {
				o.Token, o.Answer = true, true
			} else if nonEmptyStr(delta["reasoning_content"]) || nonEmptyStr(delta["reasoning"]) {
				o.Token = true
			}
		}
	}
	if u, isObj := doc["usage"].(map[string]any); isObj {
		in, hasIn := u["prompt_tokens"]
		out, hasOut := u["completion_tokens"]
		var okIn, okOut bool
		o.HasIn, o.HasOut = hasIn, hasOut
		o.In, okIn = smallInt(in, hasIn)
		o.Out, okOut = smallInt(out, hasOut)
		if !okIn || !okOut {
			return o, false // numbers where the two readings may differ
		}
		if d, isObj := u["prompt_tokens_details"].(map[string]any); isObj {
			c, hasC := d["cached_tokens"]
			var okC bool
			o.HasCached = hasC
			if o.Cached, okC = smallInt(c, hasC); !okC {
				return o, false
			}
		} else if _, has := u["prompt_tokens_details"]; has {
			return o, false // not an object: gjson's path reading differs; the table tests cover it
		}
		if d, isObj := u["completion_tokens_details"].(map[string]any); isObj {
			r, hasR := d["reasoning_tokens"]
			var okR bool
			o.HasReasoning = hasR
			if o.Reasoning, okR = smallInt(r, hasR); !okR {
				return o, false
			}
		} else if _, has := u["completion_tokens_details"]; has {
			return o, false
		}
	}
	if _, has := doc["timings"]; has {
		return o, false // llama.cpp timings: covered by the table tests
	}
	if _, has := doc["metrics"]; has {
		return o, false // vLLM's per-request metrics: covered by the fixtures
	}
	if e, has := doc["error"]; has && e != nil {
		o.Error = true
	}
	return o, true
}

func smallInt(v any, present bool) (int, bool) {
	if !present {
		return 0, true
	}
	f, isNum := v.(float64)
	if !isNum || f != math.Trunc(f) || f < 0 || f > 1e9 {
		return 0, false
	}
	return int(f), true
}

// hasDuplicateKeys reports an object with a repeated key anywhere: there
// encoding/json keeps the last value and gjson the first, and both are
// defensible readings.
func hasDuplicateKeys(data []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(data))
	type frame struct {
		keys   map[string]bool
		object bool
		expect bool // next string token is a key
	}
	var stack []*frame
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		var top *frame
		if len(stack) > 0 {
			top = stack[len(stack)-1]
		}
		switch v := tok.(type) {
		case json.Delim:
			switch v {
			case '{', '[':
				if top != nil && top.object {
					top.expect = true
				}
				stack = append(stack, &frame{keys: map[string]bool{}, object: v == '{', expect: v == '{'})
			default:
				stack = stack[:len(stack)-1]
			}
		case string:
			if top != nil && top.object && top.expect {
				if top.keys[v] {
					return true
				}
				top.keys[v] = true
				top.expect = false
				continue
			}
			if top != nil && top.object {
				top.expect = true
			}
		default:
			if top != nil && top.object {
				top.expect = true
			}
		}
	}
}

func FuzzOpenAIEvent(f *testing.F) {
	for _, s := range []string{
		`{"choices":[{"index":0,"delta":{"content":"Hi"}}]}`,
		`{"choices":[{"delta":{"role":"assistant","content":""}}]}`,
		`{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}`,
		`{"choices":[{"delta":{"reasoning_content":"x"}}],"usage":{"prompt_tokens":3,"completion_tokens":4}}`,
		`{"choices":[{"text":"a"}],"usage":null}`,
		`{"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}`,
		`{"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":40,"completion_tokens_details":{"reasoning_tokens":32}}}`,
		`{"error":{"message":"boom"}}`,
		`[DONE]`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := OpenAI.Event(nil, data) // must never panic
		_ = OpenAI.Body(data)
		if len(data) == 0 || data[0] != '{' || !json.Valid(data) || hasDuplicateKeys(data) {
			return
		}
		want, ok := referenceOpenAI(data)
		if !ok {
			return
		}
		if got != want {
			t.Fatalf("%s:\n gjson %+v\n  json %+v", data, got, want)
		}
	})
}
