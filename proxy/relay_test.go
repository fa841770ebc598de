package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

func TestByteIdentityAndHeaders(t *testing.T) {
	// An SSE body with every line ending, a comment, a BOM, invalid UTF-8
	// and multi-line data, sent in odd pieces.
	stream := "\ufeff: hello\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\r\rdata: x\ndata: y\n\n" +
		"data: \xff\xfe\n\n" + chatChunk("b") + "data: [DONE]\n\n"
	var gotHeader http.Header
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		gotHeader = r.Header.Clone()
		gotHeader.Set("Host", r.Host)
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("X-Upstream", "1")
		w.Header().Set("Keep-Alive", "timeout=5")
		w.Header().Set("X-Echo-Len", fmt.Sprint(len(body)))
		for i := 0; i < len(stream); i += 7 {
			io.WriteString(w, stream[i:min(i+7, len(stream))])
			flush(w)
		}
	})
	tp := startProxy(t, up.URL, nil)
	req, _ := http.NewRequest("POST", tp.url+"/v1/chat/completions?x=1&y=%2F", strings.NewReader(`{"model":"m","stream":true}`))
	req.Header.Set("Connection", "X-Secret-Hop")
	req.Header.Set("X-Secret-Hop", "drop me")
	req.Header.Set("Te", "trailers")
	req.Header.Set("X-Forwarded-For", "10.0.0.1")
	req.Header.Set("X-Request-Id", "req-42")
	req.Header.Set("Authorization", "Bearer sk-abc")
	resp, err := http.DefaultTransport.(*http.Transport).RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, []byte(stream)) {
		t.Fatalf("body differs:\n got %q\nwant %q", got, stream)
	}
	// The upstream's Keep-Alive is about its own connection: the client
	// is told tokentap's idle timeout instead.
	if resp.Header.Get("X-Upstream") != "1" || resp.Header.Get("Keep-Alive") != "timeout=120" || resp.Header.Get("X-Request-Id") != "req-42" {
		t.Fatalf("response headers: %v", resp.Header)
	}
	if gotHeader.Get("X-Secret-Hop") != "" || gotHeader.Get("Te") != "" {
		t.Fatalf("hop-by-hop headers reached the upstream: %v", gotHeader)
	}
	if gotHeader.Get("X-Forwarded-For") != "10.0.0.1, 127.0.0.1" || gotHeader.Get("X-Forwarded-Proto") != "http" ||
		gotHeader.Get("X-Request-Id") != "req-42" || gotHeader.Get("Authorization") != "Bearer sk-abc" {
		t.Fatalf("forwarded headers: %v", gotHeader)
	}
	if h := gotHeader.Get("Host"); h != strings.TrimPrefix(up.URL, "http://") {
		t.Fatalf("Host = %q", h)
	}
	rec := tp.rec.next(t)
	if rec.RequestID != "req-42" || rec.Events != 2 || rec.BytesOut != int64(len(stream)) || rec.Outcome != metrics.OutcomeOK || !rec.Stream {
		t.Fatalf("record: %+v", rec)
	}
}

func TestRequestIDGeneratedAndURIPreserved(t *testing.T) {
	var seenID, seenURI string
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		seenID, seenURI = r.Header.Get("X-Request-Id"), r.RequestURI
		io.WriteString(w, "ok")
	})
	tp := startProxy(t, up.URL, nil)
	resp, err := http.Get(tp.url + "/a/../b//c?q=%20x")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	id := resp.Header.Get("X-Request-Id")
	if len(id) != 32 || id != seenID {
		t.Fatalf("request id: response %q upstream %q", id, seenID)
	}
	// The path is forwarded normalised, the query as the client sent it.
	if seenURI != "/b/c?q=%20x" {
		t.Fatalf("upstream saw URI %q", seenURI)
	}
	if rec := tp.rec.next(t); rec.RequestID != id || rec.Path != "/b/c" || rec.Method != "GET" {
		t.Fatalf("record: %+v", rec)
	}
}

// Compressed responses pass through byte for byte; the parser reads a
// decompressed copy, event by event as the compressed chunks arrive.
func TestCompressedStreamsPassThroughAndAreMeasured(t *testing.T) {
	const events, gap = 4, 30 * time.Millisecond
	for enc, newWriter := range streamEncoders {
		t.Run(enc, func(t *testing.T) {
			var sent bytes.Buffer
			up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				w.Header().Set("Content-Encoding", codingOf(enc))
				zw := newWriter(io.MultiWriter(w, &sent))
				for k := 0; k < events; k++ {
					if k > 0 {
						time.Sleep(gap)
					}
					io.WriteString(zw, chatChunk("z"))
					zw.Flush()
					flush(w)
				}
				io.WriteString(zw, `data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}`+"\n\ndata: [DONE]\n\n")
				zw.Close()
			})
			tp := startProxy(t, up.URL, nil)
			tr := &http.Transport{DisableCompression: true}
			resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if !bytes.Equal(got, sent.Bytes()) || resp.Header.Get("Content-Encoding") != codingOf(enc) {
				t.Fatalf("compressed body changed: %d bytes vs %d, encoding %q", len(got), sent.Len(), resp.Header.Get("Content-Encoding"))
			}
			rec := tp.rec.next(t)
			if rec.Partial || rec.Events != events || rec.OutputTokens != 4 || rec.TokensSource != "usage" || rec.Outcome != metrics.OutcomeOK {
				t.Fatalf("record: %+v", rec)
			}
			// Every gap measured (that events are measured as they arrive,
			// against the client's clock, is TestFaultCompressedStreamsOnTime).
			if rec.ITLCount != events-1 {
				t.Fatalf("itl count=%d, want %d", rec.ITLCount, events-1)
			}
		})
	}
}

func TestUnknownEncodingMarkedPartial(t *testing.T) {
	body := "\x00\x01opaque"
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "compress")
		io.WriteString(w, body)
	})
	tp := startProxy(t, up.URL, nil)
	tr := &http.Transport{DisableCompression: true}
	resp, err := tr.RoundTrip(mustReq(t, "POST", tp.url+"/v1/chat/completions", `{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != body {
		t.Fatalf("body %q", got)
	}
	if rec := tp.rec.next(t); !rec.Partial || rec.Outcome != metrics.OutcomeOK {
		t.Fatalf("record: %+v", rec)
	}
}

func TestNonStreamedUsageAndLength(t *testing.T) {
	body := `{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":11,"completion_tokens":22}}`
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		time.Sleep(30 * time.Millisecond)
		io.WriteString(w, body)
	})
	tp := startProxy(t, up.URL, nil)
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"gpt"}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != body || resp.ContentLength != int64(len(body)) {
		t.Fatalf("body %q, length %d", got, resp.ContentLength)
	}
	rec := tp.rec.next(t)
	if rec.InputTokens != 11 || rec.OutputTokens != 22 || rec.TokensSource != "usage" || rec.Stream || rec.Model != "gpt" {
		t.Fatalf("record: %+v", rec)
	}
	if rec.TTFT != metrics.Absent || rec.ITLCount != 0 || rec.E2E < 30*time.Millisecond || rec.UpstreamTTFB < 30*time.Millisecond {
		t.Fatalf("timings: ttft=%v itl=%d e2e=%v ttfb=%v", rec.TTFT, rec.ITLCount, rec.E2E, rec.UpstreamTTFB)
	}
}

func mustReq(t *testing.T, method, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// Request bodies reach the upstream byte for byte, whatever their framing.
func TestRequestBodiesForwarded(t *testing.T) {
	type seen struct {
		body []byte
		cl   int64
		te   []string
	}
	got := make(chan seen, 1)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{b, r.ContentLength, r.TransferEncoding}
	})
	tp := startProxy(t, up.URL, nil)
	big := bytes.Repeat([]byte(`{"k":"\u00e9\u2713"},`), 60000) // ~1 MB
	for name, send := range map[string]func() (*http.Response, error){
		"content-length": func() (*http.Response, error) {
			return http.Post(tp.url+"/x", "application/json", bytes.NewReader(big))
		},
		"chunked": func() (*http.Response, error) {
			return http.Post(tp.url+"/x", "application/json", io.MultiReader(bytes.NewReader(big))) // unknown length: chunked
		},
		"empty": func() (*http.Response, error) {
			return http.Post(tp.url+"/x", "application/json", nil)
		},
	} {
		resp, err := send()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		resp.Body.Close()
		s := <-got
		want := big
		if name == "empty" {
			want = nil
		}
		if !bytes.Equal(s.body, want) || len(s.te) != 0 || s.cl != int64(len(want)) {
			t.Fatalf("%s: upstream got %d bytes (cl %d, te %v), want %d", name, len(s.body), s.cl, s.te, len(want))
		}
		if rec := tp.rec.next(t); rec.BytesIn != int64(len(want)) {
			t.Fatalf("%s: bytes_in %d", name, rec.BytesIn)
		}
	}
}

// An event over the size bound still passes through byte for byte; the
// record is marked partial and the relay goes on measuring.
func TestOversizedEventPassesThroughMarkedPartial(t *testing.T) {
	huge := `data: {"choices":[{"delta":{"content":"` + strings.Repeat("x", 5000) + `"}}]}` + "\n\n"
	stream := chatChunk("a") + huge + chatChunk("b") + "data: [DONE]\n\n"
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, stream)
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.MaxEventBytes = 1024 })
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != stream {
		t.Fatalf("body changed: %d bytes, want %d", len(got), len(stream))
	}
	rec := tp.rec.next(t)
	if !rec.Partial || rec.Events != 2 || rec.Outcome != metrics.OutcomeOK || rec.BytesOut != int64(len(stream)) {
		t.Fatalf("record: %+v", rec)
	}
}

// With inject_usage, a streaming request without include_usage reaches the
// upstream with it, and the client receives the stream without the usage
// chunk; the record has the real usage. Events split across reads, comments
// and a client that asked for usage itself are all handled.
func TestInjectUsage(t *testing.T) {
	usageChunk := `data: {"id":"c","choices":[],"usage":{"prompt_tokens":21,"completion_tokens":3}}` + "\n\n"
	head := ": ping\n\n" + chatChunk("a") + chatChunk("b")
	tail := `data: {"id":"c","choices":[{"delta":{},"finish_reason":"stop"}]}` + "\n\n"
	var gotBody []byte
	var gotAE string
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		gotBody, _ = io.ReadAll(r.Body)
		gotAE = r.Header.Get("Accept-Encoding")
		w.Header().Set("Content-Type", "text/event-stream")
		stream := head + chatChunk("c") + tail
		if strings.Contains(string(gotBody), `"include_usage":true`) {
			stream += usageChunk
		}
		stream += "data: [DONE]\n\n"
		for i := 0; i < len(stream); i += 5 { // events split across reads
			io.WriteString(w, stream[i:min(i+5, len(stream))])
			flush(w)
		}
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].InjectUsage = true })
	post := func(body string) string {
		req := mustReq(t, "POST", tp.url+"/v1/chat/completions", body)
		req.Header.Set("Accept-Encoding", "gzip")
		resp, err := (&http.Transport{DisableCompression: true}).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return string(b)
	}

	got := post(`{"model":"m","stream":true,"messages":[]}`)
	if want := head + chatChunk("c") + tail + "data: [DONE]\n\n"; got != want {
		t.Fatalf("client stream:\n got %q\nwant %q", got, want)
	}
	if !strings.Contains(string(gotBody), `"stream_options":{"include_usage":true}`) || gotAE != "" {
		t.Fatalf("upstream got body %s, Accept-Encoding %q", gotBody, gotAE)
	}
	rec := tp.rec.next(t)
	if rec.TokensSource != "usage" || rec.OutputTokens != 3 || rec.InputTokens != 21 || rec.Events != 3 || rec.BytesOut != int64(len(got)) {
		t.Fatalf("record: %+v", rec)
	}

	// The client asked for usage itself: nothing is changed.
	got = post(`{"model":"m","stream":true,"stream_options":{"include_usage":true}}`)
	if want := head + chatChunk("c") + tail + usageChunk + "data: [DONE]\n\n"; got != want {
		t.Fatalf("client's own usage chunk removed:\n got %q", got)
	}
	if gotAE != "gzip" {
		t.Fatalf("Accept-Encoding dropped without injection")
	}
	if rec := tp.rec.next(t); rec.OutputTokens != 3 || rec.TokensSource != "usage" {
		t.Fatalf("record: %+v", rec)
	}
}

// An event larger than the bound cannot be held back: stripping stops and
// every byte still reaches the client.
func TestInjectUsageGivesUpOnHugeEvent(t *testing.T) {
	big := chatChunk(strings.Repeat("x", 300))
	stream := chatChunk("a") + big + "data: [DONE]\n\n"
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < len(stream); i += 50 {
			io.WriteString(w, stream[i:min(i+50, len(stream))])
			flush(w)
		}
	})
	tp := startProxy(t, up.URL, func(c *Config) { c.Routes[0].InjectUsage, c.MaxEventBytes = true, 100 })
	resp, err := http.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader(`{"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != stream {
		t.Fatalf("got %q\nwant %q", got, stream)
	}
	if rec := tp.rec.next(t); rec.BytesOut != int64(len(stream)) || !rec.Partial {
		t.Fatalf("record: %+v", rec)
	}
}

// Responses without a body (HEAD, 204, 304) end at once, with their headers.
func TestResponsesWithoutBody(t *testing.T) {
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/204":
			w.WriteHeader(204)
		case "/304":
			w.WriteHeader(304)
		default:
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", "42")
			if r.Method != "HEAD" {
				io.WriteString(w, strings.Repeat("x", 42))
			}
		}
	})
	tp := startProxy(t, up.URL, nil)
	c, br := rawRequest(t, tp.addr, "")
	for _, tc := range []struct {
		method, path string
		status       int
		length       string
	}{
		{"HEAD", "/x", 200, "42"}, {"GET", "/204", 204, ""}, {"GET", "/304", 304, ""}, {"GET", "/x", 200, "42"},
	} {
		io.WriteString(c, tc.method+" "+tc.path+" HTTP/1.1\r\nHost: x\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		resp, err := http.ReadResponse(br, &http.Request{Method: tc.method})
		if err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status || resp.Header.Get("Content-Length") != tc.length || (tc.method == "HEAD" && len(b) != 0) {
			t.Fatalf("%s %s: %d %v body %d bytes", tc.method, tc.path, resp.StatusCode, resp.Header, len(b))
		}
		if rec := tp.rec.next(t); rec.Status != tc.status || rec.Outcome != metrics.OutcomeOK {
			t.Fatalf("%s %s: record %+v", tc.method, tc.path, rec)
		}
	}
}

// strip_prefix and a path in the upstream URL shape the forwarded URI.
func TestStripPrefixAndBasePath(t *testing.T) {
	seen := make(chan string, 4)
	up := startUpstream(t, func(w http.ResponseWriter, r *http.Request) { seen <- r.RequestURI })
	tp := startProxy(t, up.URL, func(c *Config) {
		c.Routes = []Route{
			{Name: "slash", Prefix: "/ollama/", Upstream: up.URL, StripPrefix: true, Timeouts: DefaultTimeouts},
			{Name: "bare", Prefix: "/vllm", Upstream: up.URL + "/base/", StripPrefix: true, Timeouts: DefaultTimeouts},
			{Name: "keep", Prefix: "/v1/", Upstream: up.URL + "/base", Timeouts: DefaultTimeouts},
		}
	})
	for path, want := range map[string]string{
		"/ollama/api/chat?x=1": "/api/chat?x=1",
		"/vllm/v1/models":      "/base/v1/models",
		"/vllm?q":              "/base/?q",
		"/v1/models":           "/base/v1/models",
	} {
		resp, err := http.Get(tp.url + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got := <-seen; got != want {
			t.Errorf("%s forwarded as %s, want %s", path, got, want)
		}
		tp.rec.next(t)
	}
}
