// Command tokentap-bench is an LLM-aware load generator for any
// OpenAI-compatible endpoint, and tokentap's side-by-side proxy bench.
//
//	tokentap-bench -url http://127.0.0.1:8080/v1/chat/completions -concurrency 16 -requests 500
//	tokentap-bench -url … -rate 20 -burstiness 0.5 -duration 60s -slo ttft=500ms,tpot=50ms
//	tokentap-bench -url … -access-log tokentap.log     # compare with what tokentap recorded
//	tokentap-bench matrix -url … -json before.json      # the 18-condition upgrade grid
//	tokentap-bench compare before.json after.json
//	tokentap-bench proxies -out bench/                 # direct vs tokentap vs nginx vs HAProxy
//	tokentap-bench frontier -out bench/                # open loop: added p99, frontier, stream ceiling, costs
//	tokentap-bench overload -out bench/                # goodput against offered load, overload control off and on
//
// It measures on the client side: time to first token (first SSE event
// with a non-empty delta), the gaps between token events, time per output
// token, end-to-end time, throughput and goodput against SLOs.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

func main() {
	args := os.Args[1:]
	var err error
	switch {
	case len(args) > 0 && args[0] == "matrix":
		err = runMatrix(args[1:], os.Stdout)
	case len(args) > 0 && args[0] == "compare":
		err = runCompare(args[1:], os.Stdout)
	case len(args) > 0 && args[0] == "proxies":
		err = runProxies(args[1:], os.Stdout)
	case len(args) > 0 && args[0] == "frontier":
		err = runFrontier(args[1:], os.Stdout)
	case len(args) > 0 && args[0] == "overload":
		err = runOverload(args[1:], os.Stdout)
	case len(args) > 0 && args[0] == "relay":
		err = runRelay(args[1:])
	case len(args) > 0 && args[0] == "fasthttp-relay":
		err = runFastRelay(args[1:])
	default:
		err = runOnce(args, os.Stdout)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tokentap-bench:", err)
		os.Exit(2)
	}
}

// common are the flags of a load.
type common struct {
	url, model, workload, prefix, sloSpec, jsonOut, headers string
	caFile                                                  string
	stream, insecure                                        bool
	timeout                                                 time.Duration
}

func (c *common) register(fs *flag.FlagSet) {
	fs.StringVar(&c.url, "url", "http://127.0.0.1:8080/v1/chat/completions", "OpenAI-compatible chat completions URL")
	fs.StringVar(&c.model, "model", "mock-llm", "model to ask for")
	fs.StringVar(&c.workload, "workload", "mixed", "request mix: chat, doc (long prompt, short answer), gen (long output), mixed, tiny, stream; comma-separated")
	fs.StringVar(&c.prefix, "prefix", "fresh", "prompt prefix: fresh (unique per request) or reused (a shared system prompt)")
	fs.BoolVar(&c.stream, "stream", true, "stream responses (SSE)")
	fs.StringVar(&c.sloSpec, "slo", "", "targets for goodput, e.g. ttft=500ms,tpot=50ms,e2e=10s")
	fs.StringVar(&c.jsonOut, "json", "", "write the results as JSON to this file")
	fs.StringVar(&c.headers, "H", "", "extra request headers, 'Name: value' separated by ;")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "per-request timeout")
	fs.StringVar(&c.caFile, "cacert", "", "https: PEM file of the CAs to trust instead of the system's roots")
	fs.BoolVar(&c.insecure, "insecure", false, "https: accept any certificate")
}

// tlsConfig is the https client's config from -cacert and -insecure (nil:
// the system's roots).
func (c *common) tlsConfig() (*tls.Config, error) {
	if c.caFile == "" && !c.insecure {
		return nil, nil
	}
	cfg := &tls.Config{InsecureSkipVerify: c.insecure, NextProtos: []string{"http/1.1"}} //nolint:gosec // asked for with -insecure
	if c.caFile != "" {
		pem, err := os.ReadFile(c.caFile)
		if err != nil {
			return nil, fmt.Errorf("-cacert: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, errors.New("-cacert: holds no PEM certificate")
		}
	}
	return cfg, nil
}

func (c *common) plan() (plan, slo, error) {
	ws, err := mix(c.workload)
	if err != nil {
		return plan{}, slo{}, err
	}
	o, err := parseSLO(c.sloSpec)
	if err != nil {
		return plan{}, slo{}, err
	}
	if c.prefix != "fresh" && c.prefix != "reused" {
		return plan{}, slo{}, fmt.Errorf("-prefix: %q must be fresh or reused", c.prefix)
	}
	h := map[string]string{}
	for _, kv := range strings.Split(c.headers, ";") {
		if k, v, ok := strings.Cut(kv, ":"); ok {
			h[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	tc, err := c.tlsConfig()
	if err != nil {
		return plan{}, slo{}, err
	}
	return plan{URL: c.url, TLS: tc, Model: c.model, Workloads: ws, Stream: c.stream, SharedPrefix: c.prefix == "reused",
		Headers: h, Timeout: c.timeout, Stamped: true}, o, nil
}

func runOnce(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("tokentap-bench", flag.ContinueOnError)
	var c common
	c.register(fs)
	conc := fs.Int("concurrency", 8, "closed loop: requests in flight")
	rate := fs.Float64("rate", 0, "open loop: arrivals per second (0: closed loop)")
	burst := fs.Float64("burstiness", 1, "open loop: gamma shape of the gaps; 1 is Poisson, below 1 burstier")
	steps := fs.String("steps", "", "open loop in steps, e.g. 5:20s,50:10s,5:20s (rate:duration)")
	n := fs.Int("requests", 200, "requests to count (0: until -duration)")
	dur := fs.Duration("duration", 0, "time to run (0: until -requests)")
	warm := fs.Int("warmup", 10, "requests sent first and not counted")
	logPath := fs.String("access-log", "", "tokentap access log to compare with, request by request")
	if err := fs.Parse(args); err != nil {
		return err
	}
	p, o, err := c.plan()
	if err != nil {
		return err
	}
	p.Concurrency, p.Rate, p.Burstiness, p.Requests, p.Duration, p.Warmup = *conc, *rate, *burst, *n, *dur, *warm
	if *steps != "" {
		if p.Steps, err = parseSteps(*steps); err != nil {
			return err
		}
	}
	if p.Requests == 0 && p.Duration == 0 && len(p.Steps) == 0 {
		return fmt.Errorf("give -requests or -duration")
	}
	p.IDPrefix = fmt.Sprintf("r%d-", time.Now().UnixNano()%1e9)
	bar := newProgress(p.Requests)
	p.Progress = bar.update
	res, wall, err := run(p)
	bar.done()
	if err != nil {
		return err
	}
	s := summarize("run", res, wall, p.Warmup, o)
	if *logPath != "" {
		time.Sleep(200 * time.Millisecond) // the access log is written asynchronously
		if s.Accuracy, err = compareLog(*logPath, p.IDPrefix, res, paceOf(o)); err != nil {
			return err
		}
	}
	printSummary(out, s)
	return writeJSON(c.jsonOut, map[string]any{"kind": "run", "plan": describe(p), "summary": s})
}

func describe(p plan) map[string]any {
	names := []string{}
	for _, w := range p.Workloads {
		names = append(names, w.Name)
	}
	return map[string]any{"url": p.URL, "model": p.Model, "workloads": names, "stream": p.Stream, "shared_prefix": p.SharedPrefix,
		"concurrency": p.Concurrency, "rate": p.Rate, "burstiness": p.Burstiness, "requests": p.Requests,
		"duration_s": p.Duration.Seconds(), "warmup": p.Warmup}
}

func writeJSON(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
