package proxy

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/metrics/stats"
)

// deployment is a backend that answers with its name, counting what it got.
type deployment struct {
	url  string
	hits atomic.Int64
}

func startDeployment(t *testing.T, name string) *deployment {
	d := &deployment{}
	srv := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		d.hits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"served_by":"`+name+`"}`)
	})
	d.url = srv.URL
	return d
}

// ask posts body to url+path and returns the status and the body.
func ask(t *testing.T, url, path, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestRoutesByModel: two deployments on one prefix, told apart by the
// model the body names; each model's requests reach only its deployment
// (and its record says so); a model no route serves gets the dialect's own
// 404 model_not_found, in Anthropic's shape on an Anthropic path, and
// reaches no backend; a longer prefix without models still wins; with a
// route without models at the prefix, the unknown model goes there.
func TestRoutesByModel(t *testing.T) {
	alpha, beta, embed, rest := startDeployment(t, "alpha"), startDeployment(t, "beta"), startDeployment(t, "embed"), startDeployment(t, "rest")
	routes := []Route{
		{Name: "alpha", Prefix: "/v1/", Models: []string{"alpha-*"}, Upstream: alpha.url, Timeouts: DefaultTimeouts},
		{Name: "beta", Prefix: "/v1/", Models: []string{"beta-70b"}, Upstream: beta.url, Timeouts: DefaultTimeouts},
		{Name: "embed", Prefix: "/v1/embeddings", Upstream: embed.url, Timeouts: DefaultTimeouts},
	}
	tp := startProxy(t, "", func(c *Config) { c.Routes = append([]Route(nil), routes...) })

	cases := []struct {
		path, model, want string
	}{
		{"/v1/chat/completions", "alpha-8b", "alpha"},
		{"/v1/chat/completions", "alpha-70b-instruct", "alpha"},
		{"/v1/chat/completions", "beta-70b", "beta"},
		{"/v1/completions", "beta-70b", "beta"},
		{"/v1/embeddings", "beta-70b", "embed"},
		{"/v1/messages", "alpha-1", "alpha"},
	}
	for _, c := range cases {
		status, body := ask(t, tp.url, c.path, `{"model":"`+c.model+`","messages":[]}`)
		if status != 200 || !strings.Contains(body, `"served_by":"`+c.want+`"`) {
			t.Errorf("%s %s: %d %s, want served by %s", c.path, c.model, status, body, c.want)
		}
		rec := tp.rec.next(t)
		if rec.Route != c.want {
			t.Errorf("%s %s: record's route %q, want %q", c.path, c.model, rec.Route, c.want)
		}
	}
	if alpha.hits.Load() != 3 || beta.hits.Load() != 2 || embed.hits.Load() != 1 {
		t.Errorf("hits alpha %d beta %d embed %d, want 3 2 1", alpha.hits.Load(), beta.hits.Load(), embed.hits.Load())
	}

	// A model nobody serves: 404 in the dialect's words, no backend asked.
	status, body := ask(t, tp.url, "/v1/chat/completions", `{"model":"beta-8b","messages":[]}`)
	var openai struct {
		Error struct{ Type, Code string }
	}
	if err := json.Unmarshal([]byte(body), &openai); err != nil || status != 404 || openai.Error.Code != "model_not_found" || openai.Error.Type != "invalid_request_error" {
		t.Errorf("unknown model: %d %s, want 404 model_not_found", status, body)
	}
	var named struct{ Error struct{ Message string } }
	json.Unmarshal([]byte(body), &named)
	if named.Error.Message != `the model "beta-8b" is not served here` {
		t.Errorf("the 404 does not name the model: %s", body)
	}
	if rec := tp.rec.next(t); rec.Route != "unmatched" || rec.Status != 404 || rec.Upstream != "" || rec.Model != "beta-8b" {
		t.Errorf("unknown model's record: route %q status %d upstream %q model %q", rec.Route, rec.Status, rec.Upstream, rec.Model)
	}
	// A name that is no plain one is named escaped, in a body that is
	// still JSON, bounded as the record keeps it.
	hostile := `x\"}\u0000\n` + strings.Repeat("y", 300) // JSON escapes: x"}, NUL, a line break
	status, body = ask(t, tp.url, "/v1/chat/completions", `{"model":"`+hostile+`","messages":[]}`)
	if err := json.Unmarshal([]byte(body), &named); err != nil || status != 404 || len(named.Error.Message) > 200 || !strings.Contains(named.Error.Message, `x\"}\x00\n`) {
		t.Errorf("a hostile model's 404: %d %s", status, body)
	}
	tp.rec.next(t)
	status, body = ask(t, tp.url, "/v1/messages", `{"model":"claude-x","messages":[]}`)
	var anth struct {
		Type  string
		Error struct{ Type string }
	}
	if err := json.Unmarshal([]byte(body), &anth); err != nil || status != 404 || anth.Type != "error" || anth.Error.Type != "not_found_error" {
		t.Errorf("unknown model on Anthropic's path: %d %s, want 404 not_found_error", status, body)
	}
	tp.rec.next(t)
	if n := alpha.hits.Load() + beta.hits.Load() + embed.hits.Load(); n != 6 {
		t.Errorf("a refused model reached a backend: %d requests served, want 6", n)
	}

	// A route without models at the prefix takes what the others do not.
	routes = append(routes, Route{Name: "rest", Prefix: "/v1/", Upstream: rest.url, Timeouts: DefaultTimeouts})
	cfg := tp.p.snap.Load().cfg
	cfg.Routes = routes
	if err := tp.p.Apply(cfg); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ model, want string }{{"beta-8b", "rest"}, {"alpha-1", "alpha"}, {"", "rest"}} {
		status, body := ask(t, tp.url, "/v1/chat/completions", `{"model":"`+c.model+`"}`)
		if status != 200 || !strings.Contains(body, c.want) {
			t.Errorf("with a catch-all, model %q: %d %s, want %s", c.model, status, body, c.want)
		}
		tp.rec.next(t)
	}
}

// TestRoutesByModelOnGeminiPath: Gemini names the model in the path; the
// route follows it there.
func TestRoutesByModelOnGeminiPath(t *testing.T) {
	pro, flash := startDeployment(t, "pro"), startDeployment(t, "flash")
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{
			{Name: "pro", Prefix: "/v1beta/models", Models: []string{"gemini-*-pro"}, Upstream: pro.url, Timeouts: DefaultTimeouts},
			{Name: "flash", Prefix: "/v1beta/models", Models: []string{"gemini-*-flash"}, Upstream: flash.url, Timeouts: DefaultTimeouts},
		}
	})
	for _, c := range []struct{ model, want string }{{"gemini-2.5-pro", "pro"}, {"gemini-2.5-flash", "flash"}} {
		status, body := ask(t, tp.url, "/v1beta/models/"+c.model+":generateContent", `{"contents":[]}`)
		if status != 200 || !strings.Contains(body, c.want) {
			t.Errorf("%s: %d %s, want %s", c.model, status, body, c.want)
		}
		tp.rec.next(t)
	}
	if status, _ := ask(t, tp.url, "/v1beta/models/gemini-1.0-ultra:generateContent", `{}`); status != 404 {
		t.Errorf("unknown Gemini model: %d, want 404", status)
	}
}

// TestModelsConfigRefused: routes sharing a prefix must be told apart by
// their models, and a glob must not be empty; the field is named.
func TestModelsConfigRefused(t *testing.T) {
	base := func(rs ...Route) Config {
		for i := range rs {
			rs[i].Upstream, rs[i].Timeouts = "http://127.0.0.1:1", DefaultTimeouts
		}
		return Config{Routes: rs}
	}
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{base(Route{Name: "a", Prefix: "/v1/"}, Route{Name: "b", Prefix: "/v1/"}), "routes[1].prefix"},
		{base(Route{Name: "a", Prefix: "/v1/", Models: []string{""}}), "routes[0].models[0]"},
	} {
		err := c.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("config %+v: %v, want an error naming %s", c.cfg.Routes, err, c.want)
		}
	}
	ok := base(Route{Name: "a", Prefix: "/v1/", Models: []string{"x*"}}, Route{Name: "b", Prefix: "/v1/", Models: []string{"y"}}, Route{Name: "c", Prefix: "/v1/"})
	if err := ok.Validate(); err != nil {
		t.Errorf("routes told apart by models refused: %v", err)
	}
}

// TestModelsByName: with no allowlist, a model a route's globs name
// literally is its own label on tokentap_requests_total and in /stats;
// on a route without models, the first two others it sees (per_route 2)
// are too, and the third, and a name that is no plain model name, are
// "other", counted as folded; a reload keeps what the route learned.
func TestModelsByName(t *testing.T) {
	named, any := startDeployment(t, "named"), startDeployment(t, "any")
	tp := startProxy(t, "", func(c *Config) {
		c.Routes = []Route{
			{Name: "byname", Prefix: "/v1/", Models: []string{"llama-3-70b", "qwen*"}, Upstream: named.url, Timeouts: DefaultTimeouts},
			{Name: "learns", Prefix: "/learn/", Upstream: any.url, Timeouts: DefaultTimeouts},
		}
		c.ModelsPerRoute = 2
	})
	label := func(path, model string) string {
		t.Helper()
		if status, body := ask(t, tp.url, path, `{"model":"`+model+`","messages":[]}`); status != 200 {
			t.Fatalf("%s %s: %d %s", path, model, status, body)
		}
		return tp.rec.next(t).Series.Model()
	}
	count := func(route, model string) float64 {
		return promFloat(t, `tokentap_requests_total{route="`+route+`",model="`+model+`",outcome="ok",status_class="2xx"}`)
	}
	folded0 := promFloat(t, `tokentap_models_folded_total{route="learns"}`)
	before := count("byname", "llama-3-70b")
	for _, c := range []struct{ path, model, want string }{
		{"/v1/chat/completions", "llama-3-70b", "llama-3-70b"},
		{"/v1/chat/completions", "qwen-7b", "qwen-7b"}, // learned: the route has room
		{"/learn/v1/chat/completions", "m-one", "m-one"},
		{"/learn/v1/chat/completions", "m-two", "m-two"},
		{"/learn/v1/chat/completions", "m-three", metrics.OtherModel},
		{"/learn/v1/chat/completions", "m-one", "m-one"},
		{"/learn/v1/chat/completions", "bad name", metrics.OtherModel},
	} {
		if got := label(c.path, c.model); got != c.want {
			t.Errorf("%s %s: label %q, want %q", c.path, c.model, got, c.want)
		}
	}
	if d := count("byname", "llama-3-70b") - before; d != 1 {
		t.Errorf("tokentap_requests_total for llama-3-70b moved by %v, want 1", d)
	}
	if d := promFloat(t, `tokentap_models_folded_total{route="learns"}`) - folded0; d != 2 {
		t.Errorf("tokentap_models_folded_total moved by %v, want 2", d)
	}
	rep := tp.p.Stats().Query(stats.Query{Window: "all", GroupBy: []string{"route", "model"}})
	found := map[string]bool{}
	for _, g := range rep.Groups {
		found[g.Route+"/"+g.Model] = true
	}
	for _, k := range []string{"byname/llama-3-70b", "byname/qwen-7b", "learns/m-one", "learns/m-two", "learns/" + metrics.OtherModel} {
		if !found[k] {
			t.Errorf("/stats has no group %s: %v", k, found)
		}
	}
	// A reload keeps what the route learned.
	if err := tp.p.Apply(tp.p.snap.Load().cfg); err != nil {
		t.Fatal(err)
	}
	if got := label("/learn/v1/chat/completions", "m-two"); got != "m-two" {
		t.Errorf("after a reload, m-two is %q", got)
	}
	if got := label("/learn/v1/chat/completions", "m-four"); got != metrics.OtherModel {
		t.Errorf("after a reload, a third model is %q", got)
	}
}
