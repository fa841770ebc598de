// Command mockllm serves the simulated OpenAI-compatible backend of
// proxy/testkit/mockllm.
//
//	go run ./cmd/mockllm -listen 127.0.0.1:8000 -token-gap 20ms
package main

import (
	"flag"
	"fmt"
	"net/http"
	"os"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
)

func main() {
	var o mockllm.Options
	listen := flag.String("listen", "127.0.0.1:8000", "listen address")
	flag.DurationVar(&o.PrefillBase, "prefill", 0, "fixed prefill time (default 20ms)")
	flag.DurationVar(&o.PrefillPerToken, "prefill-per-token", 0, "prefill time per prompt token (default 20µs)")
	flag.DurationVar(&o.TokenGap, "token-gap", 0, "mean decode time per token (default 10ms)")
	flag.Float64Var(&o.Jitter, "jitter", 0, "relative spread of the token gap, 0..1 (default 0.2)")
	flag.IntVar(&o.MaxTokens, "max-tokens", 0, "output tokens when the request sets none (default 32)")
	flag.StringVar(&o.Model, "model", "", "model name reported (default mock-llm)")
	flag.Float64Var(&o.BatchSlowdown, "batch-slowdown", 0, "continuous batching: relative slowdown of prefill and decode per concurrent request (0: off)")
	flag.IntVar(&o.Slots, "slots", 0, "requests served at once (a server's batch); past it they wait in order (0: no bound)")
	flag.BoolVar(&o.PrefixCache, "prefix-cache", false, "model prefix caching: repeated prompt prefixes cost no prefill")
	flag.BoolVar(&o.Stamp, "stamp", false, "add mock_sent (Unix ns) to streamed chat chunks, for delivery-delay benchmarks")
	flag.Parse()
	fmt.Fprintf(os.Stderr, "mockllm listening on %s\n", *listen)
	if err := http.ListenAndServe(*listen, mockllm.New(o)); err != nil {
		fmt.Fprintln(os.Stderr, "mockllm:", err)
		os.Exit(1)
	}
}
