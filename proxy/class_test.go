package proxy

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/tokentap/tokentap/metrics/stats"
)

// Each record carries its class: the input size from the usage the
// backend reported (else the body's bytes / 4), the output size, and
// whether the prefix was reused where the backend says (cached tokens);
// /stats groups and filters by it.
func TestRequestClasses(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		var usage string
		switch r.Header.Get("X-Usage") {
		case "reused":
			usage = `,"usage":{"prompt_tokens":5000,"completion_tokens":600,"prompt_tokens_details":{"cached_tokens":4096}}`
		case "fresh":
			usage = fmt.Sprintf(`,"usage":{"prompt_tokens":%d,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}`, len(body)/4)
		}
		text := "hi"
		if r.Header.Get("X-Usage") == "reused" {
			text = strings.Repeat(" w", 600) // 600 tokens' text: usage past what the bytes carry is set aside
		}
		io.WriteString(w, `data: {"choices":[{"delta":{"content":"`+text+`"}}]}`+"\n\n")
		io.WriteString(w, `data: {"choices":[]`+usage+"}\n\n")
		io.WriteString(w, "data: [DONE]\n\n")
	})
	tp := startProxy(t, up.URL, nil)
	long := `{"stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 20_000) + `"}]}`
	for _, c := range []struct {
		body, usage, want string
		cached            int
	}{
		{`{"stream":true}`, "fresh", "in-short.out-short.prefix-fresh", 0},
		{long, "fresh", "in-long.out-short.prefix-fresh", 0},
		{`{"stream":true}`, "reused", "in-long.out-long.prefix-reused", 4096},
		{long, "", "in-long.out-short", -1}, // no usage: the body's size, no prefix
	} {
		req, _ := http.NewRequest("POST", tp.url+"/v1/chat/completions", strings.NewReader(c.body))
		req.Header.Set("X-Usage", c.usage)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if r := tp.rec.next(t); r.Class != c.want || r.CachedTokens != c.cached {
			t.Errorf("%s usage, %d-byte body: class %q, %d cached; want %q, %d", c.usage, len(c.body), r.Class, r.CachedTokens, c.want, c.cached)
		}
	}
	rep := tp.p.Stats().Query(stats.Query{Window: "all", GroupBy: []string{"class"}})
	if len(rep.Groups) != 4 {
		t.Fatalf("grouped by class: %d groups, want 4: %+v", len(rep.Groups), rep.Groups)
	}
	if one := tp.p.Stats().Query(stats.Query{Window: "all", Class: "in-long.out-short"}); len(one.Groups) != 1 || one.Groups[0].Count != 1 {
		t.Fatalf("filtered by class: %+v", one.Groups)
	}
	if all := tp.p.Stats().Query(stats.Query{Window: "all"}); len(all.Groups) != 1 || all.Groups[0].Count != 4 {
		t.Fatalf("by default classes merge: %+v", all.Groups)
	}
}

// A guard's class that is not one is a config error naming the field
// (routing's TestGuardLimitedToAClass weighs a class's requests alone).
func TestGuardClassChecked(t *testing.T) {
	cfg := Config{Routes: []Route{{Name: "r", Prefix: "/", Timeouts: DefaultTimeouts,
		Upstreams: []Upstream{{Name: "b", URL: "http://127.0.0.1:1", Weight: 1}, {Name: "c", URL: "http://127.0.0.1:2", Weight: 1}},
		Guard:     &Guard{Candidate: "c", Baseline: "b", Class: "long", MaxTTFTP95Increase: 0.1}}}}
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "guard.class") {
		t.Fatalf("a guard's unknown class: %v", err)
	}
	cfg.Classes = Classes{InputTokens: [2]int{4096, 1024}}
	cfg.Routes[0].Guard.Class = ""
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "classes.input_tokens") {
		t.Fatalf("thresholds out of order: %v", err)
	}
}
