package dialect

import (
	"bytes"

	"github.com/tidwall/gjson"
)

// gemini reads Google Gemini's :generateContent and
// :streamGenerateContent (with ?alt=sse for SSE; without it the stream is
// one JSON array, read as a body when it ends).
//
// Token event: a chunk with a part of candidates[].content.parts[] that has
// a non-empty "text" or a "functionCall"; it is an answer unless the part
// has "thought": true. Usage: usageMetadata, in every chunk and cumulative
// (the last one wins): input promptTokenCount, output candidatesTokenCount
// + thoughtsTokenCount. Error: a top-level "error" object. The model comes
// from the path (/models/{model}:…).
type gemini struct{}

// Gemini is the dialect of Google's Gemini API.
var Gemini Dialect = gemini{}

func (gemini) Name() string { return "gemini" }

func (gemini) Request(path, _ []byte) Request {
	var r Request
	if i := bytes.Index(path, []byte("/models/")); i >= 0 {
		m := path[i+len("/models/"):]
		if j := bytes.IndexByte(m, ':'); j >= 0 {
			r.Model = m[:j]
			r.Stream = bytes.HasPrefix(m[j:], []byte(":streamGenerateContent"))
		}
	}
	return r
}

func (gemini) Event(_, data []byte) Obs {
	var o Obs
	readGemini(object(data), &o)
	return o
}

func (gemini) Body(body []byte) Obs {
	var o Obs
	body = bytes.TrimSpace(body)
	if len(body) > 0 && body[0] == '[' {
		// streamGenerateContent without alt=sse: an array of chunks.
		gjson.Parse(str(body)).ForEach(func(_, c gjson.Result) bool {
			var one Obs
			readGemini(c.Raw, &one)
			o.Token = o.Token || one.Token
			o.Answer = o.Answer || one.Answer
			o.Error = o.Error || one.Error
			o.BadUsage = o.BadUsage || one.BadUsage
			if one.HasIn || one.HasOut {
				o.HasIn, o.In, o.HasOut, o.Out = one.HasIn, one.In, one.HasOut, one.Out
				o.HasCached, o.Cached = one.HasCached, one.Cached
				o.HasReasoning, o.Reasoning = one.HasReasoning, one.Reasoning
			}
			return true
		})
		return o
	}
	readGemini(object(body), &o)
	return o
}

func readGemini(s string, o *Obs) {
	if s == "" {
		return
	}
	if cands := gjson.Get(s, "candidates"); cands.IsArray() {
		cands.ForEach(func(_, c gjson.Result) bool {
			gjson.Get(c.Raw, "content.parts").ForEach(func(_, p gjson.Result) bool {
				if nonEmptyString(gjson.Get(p.Raw, "text")) || gjson.Get(p.Raw, "functionCall").IsObject() {
					o.Token = true
					if gjson.Get(p.Raw, "thought").Type != gjson.True {
						o.Answer = true
					}
				}
				return true
			})
			return true
		})
	}
	if u := gjson.Get(s, "usageMetadata"); u.IsObject() {
		if v := gjson.Get(u.Raw, "promptTokenCount"); v.Exists() {
			o.HasIn, o.In = o.count(v)
		}
		if v := gjson.Get(u.Raw, "cachedContentTokenCount"); v.Exists() {
			o.HasCached, o.Cached = o.count(v)
		}
		// Output is the answer's tokens and the thoughts'.
		hasC, c := o.count(gjson.Get(u.Raw, "candidatesTokenCount"))
		o.HasReasoning, o.Reasoning = o.count(gjson.Get(u.Raw, "thoughtsTokenCount"))
		if hasC || o.HasReasoning {
			o.HasOut, o.Out = true, c+o.Reasoning
		}
	}
	if gjson.Get(s, "error").IsObject() {
		o.Error = true
	}
}
