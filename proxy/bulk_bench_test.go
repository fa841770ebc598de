package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
)

// BenchmarkBulkBody is a 32 MiB response relayed whole through a real
// proxy on loopback to a real client: the relay's bulk throughput, with
// the client sockets' limit on bytes waiting unsent (downstream.MaxUnsent)
// in the way.
func BenchmarkBulkBody(b *testing.B) {
	const size = 32 << 20
	chunk := make([]byte, 256<<10)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		for n := 0; n < size; n += len(chunk) {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	defer up.Close()
	p, err := New(Config{Routes: []Route{{Name: "default", Prefix: "/", Upstream: up.URL, Timeouts: DefaultTimeouts}}}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	ln, err := p.Listen("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = p.Serve(ln) }()
	defer p.Close()
	url := "http://" + ln.Addr().String()
	client := &http.Client{}
	b.SetBytes(size)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		resp, err := client.Get(url + "/bulk")
		if err != nil {
			b.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if n != size {
			b.Fatalf("%d bytes of %d", n, size)
		}
	}
}
