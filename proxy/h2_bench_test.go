package proxy

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// BenchmarkClientProtocol: one small streamed request after another
// through tokentap, its client over HTTP/1.1 or HTTP/2 (h2c) on one
// kept connection: what a request costs each way, side by side (the
// client's cost included, the same backend).
func BenchmarkClientProtocol(b *testing.B) {
	up := &echoStream{n: 4}
	srv := startUpstream(b, up.ServeHTTP)
	for _, c := range []struct {
		name   string
		client *http.Client
	}{{"HTTP1", &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}}, {"HTTP2", h2cClient()}} {
		b.Run(c.name, func(b *testing.B) {
			tp := startProxy(b, srv.URL, nil)
			b.ReportAllocs()
			for b.Loop() {
				resp, err := c.client.Post(tp.url+"/v1/chat/completions", "application/json", strings.NewReader("x"))
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
}
