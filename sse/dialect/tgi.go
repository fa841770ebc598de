package dialect

import (
	"bytes"
	"strconv"
	"time"

	"github.com/tidwall/gjson"
)

// tgi reads Hugging Face Text Generation Inference's /generate_stream (SSE)
// and /generate. (TGI's /v1/chat/completions is read by the OpenAI dialect.)
//
// Token event: an event with a "token" object whose "special" is not true
// (a token and an answer). Usage: details.generated_tokens out, on the last
// event or the /generate body (when details were asked for); TGI reports no
// input count. Timings: response headers x-queue-time (queue) and
// x-inference-time (prefill and decode together, given as decode), in
// milliseconds, which TGI sends on /generate. Error: an "error" member.
type tgi struct{}

// TGI is the dialect of Text Generation Inference's native API.
var TGI Dialect = tgi{}

func (tgi) Name() string { return "tgi" }

func (tgi) Request(path, body []byte) Request {
	return Request{Stream: bytes.HasSuffix(path, []byte("/generate_stream"))}
}

func (tgi) Event(_, data []byte) Obs {
	var o Obs
	s := object(data)
	if s == "" {
		return o
	}
	if tok := gjson.Get(s, "token"); tok.IsObject() && gjson.Get(tok.Raw, "special").Type != gjson.True {
		o.Token, o.Answer = true, true
	}
	readTGITail(s, &o)
	return o
}

func (tgi) Body(body []byte) Obs {
	var o Obs
	s := object(body)
	if s == "" {
		// /generate may answer with an array of one result.
		if b := bytes.TrimSpace(body); len(b) > 0 && b[0] == '[' {
			s = gjson.Get(str(b), "0").Raw
		}
	}
	readTGITail(s, &o)
	return o
}

func readTGITail(s string, o *Obs) {
	if s == "" {
		return
	}
	if v := gjson.Get(s, "details.generated_tokens"); v.Exists() {
		o.HasOut, o.Out = o.count(v)
	}
	if present(gjson.Get(s, "error")) {
		o.Error = true
	}
}

// Header reads TGI's timing headers.
func (tgi) Header(get func(string) []byte) Timings {
	t := noTimings()
	t.Queue = headerMillis(get("x-queue-time"))
	t.Decode = headerMillis(get("x-inference-time"))
	if t.Queue < 0 && t.Decode < 0 {
		return Timings{}
	}
	return t
}

func headerMillis(v []byte) time.Duration {
	if len(v) == 0 {
		return -1
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || f < 0 {
		return -1
	}
	return time.Duration(f * 1e6)
}
