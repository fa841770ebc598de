package dialect

import (
	"encoding/json"
	"testing"

	"github.com/tidwall/gjson"
)

func TestInjectIncludeUsage(t *testing.T) {
	f := func(in, want string, changed bool) {
		t.Helper()
		got, ok := InjectIncludeUsage(nil, []byte(in))
		if ok != changed || (ok && string(got) != want) {
			t.Fatalf("%s:\n got %q %v\nwant %q %v", in, got, ok, want, changed)
		}
		if ok && (!json.Valid(got) || !gjson.GetBytes(got, "stream_options.include_usage").Bool()) {
			t.Fatalf("%s: result %s is not valid or lacks include_usage", in, got)
		}
	}
	f(`{"model":"m","stream":true}`, `{"stream_options":{"include_usage":true},"model":"m","stream":true}`, true)
	f(` {}`, ` {"stream_options":{"include_usage":true}}`, true)
	f(`{"stream":true,"stream_options":{}}`, `{"stream":true,"stream_options":{"include_usage":true}}`, true)
	f(`{"stream_options":{"continuous_usage_stats":true},"stream":true}`, `{"stream_options":{"include_usage":true,"continuous_usage_stats":true},"stream":true}`, true)
	f(`{"stream_options": {"include_usage": false}}`, `{"stream_options": {"include_usage": true}}`, true)
	f(`{"stream_options":null,"stream":true}`, `{"stream_options":{"include_usage":true},"stream":true}`, true)
	f(`{"stream_options":{"include_usage":true}}`, ``, false)
	f(`not json`, ``, false)
	f(`{"broken":`, ``, false)
	f(`[1,2]`, ``, false)
}

func TestUsageOnly(t *testing.T) {
	for data, want := range map[string]bool{
		`{"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}`: true,
		`{"id":"c","usage":{"prompt_tokens":1}}`:                                    true,
		`{"choices":[{"delta":{"content":"a"}}],"usage":{"prompt_tokens":1}}`:       false,
		`{"choices":[],"usage":null}`:                                               false,
		`[DONE]`:                                                                    false,
	} {
		if got := UsageOnly([]byte(data)); got != want {
			t.Errorf("%s: got %v", data, got)
		}
	}
}

func FuzzInjectIncludeUsage(f *testing.F) {
	f.Add([]byte(`{"model":"m","stream":true}`))
	f.Add([]byte(`{"stream_options":{"x":1}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		got, ok := InjectIncludeUsage(nil, body)
		if !ok {
			return
		}
		if !json.Valid(got) || !gjson.GetBytes(got, "stream_options.include_usage").Bool() {
			t.Fatalf("%q → %q", body, got)
		}
		// Everything else is unchanged.
		var a, b map[string]any
		if json.Unmarshal(body, &a) != nil || json.Unmarshal(got, &b) != nil || hasDuplicateKeys(body) {
			return
		}
		delete(a, "stream_options")
		so, _ := b["stream_options"].(map[string]any)
		delete(b, "stream_options")
		if len(a) != len(b) || so == nil {
			t.Fatalf("%q → %q: other members changed", body, got)
		}
	})
}
