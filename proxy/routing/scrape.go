package routing

import (
	"bytes"
	"errors"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"github.com/valyala/fasthttp"
)

// Backend state (upstreams[].metrics_url): the server's own Prometheus
// metrics, scraped every scrapeEvery, say how many requests it runs and
// holds waiting, all clients counted, and how full its KV cache is. The
// prediction (least_ttft, overload control) then weighs the requests it
// holds beyond tokentap's own in flight: another client's load on a shared
// backend. A scrape that fails, or is older than scrapeFresh, leaves the
// prediction to what tokentap measures itself.

const (
	scrapeEvery   = time.Second
	scrapeTimeout = 800 * time.Millisecond
	scrapeFresh   = 3 * time.Second
	// maxScrapeBytes bounds a scrape's body: a larger one is refused, not
	// held.
	maxScrapeBytes = 4 << 20
	// maxBackendRequests bounds the requests a scrape may say a backend
	// runs or holds waiting: past it (1e300, 9.3e18) the scrape is wrong,
	// and refused whole rather than read as anything.
	maxBackendRequests = 1_000_000
	// minOthers is the fewest requests beyond tokentap's own a scrape may
	// add to the level a prediction is read at (others): at most as many
	// as tokentap's own, or this many. A scrape can tell of another
	// client's load; it cannot move the level, and the curve the model
	// files what it measures by, past what tokentap's own traffic shows.
	minOthers = 16
)

// The metrics read, by server: requests running, requests waiting, and
// the KV cache's use (0–1).
var (
	runningNames = [][]byte{[]byte("vllm:num_requests_running"), []byte("sglang:num_running_reqs"),
		[]byte("llamacpp:requests_processing"), []byte("tgi_batch_current_size")}
	waitingNames = [][]byte{[]byte("vllm:num_requests_waiting"), []byte("sglang:num_queue_reqs"),
		[]byte("llamacpp:requests_deferred"), []byte("tgi_queue_size")}
	kvNames = [][]byte{[]byte("vllm:kv_cache_usage_perc"), []byte("vllm:gpu_cache_usage_perc"),
		[]byte("sglang:token_usage"), []byte("llamacpp:kv_cache_usage_ratio")}
)

// BackendState is the last scrape of one upstream's metrics.
type BackendState struct {
	Running, Waiting float64 // requests (−1: not reported)
	KV               float64 // KV cache use, 0–1 (−1: not reported)
	At               time.Time
	Err              string // the last scrape's failure ("": it answered)
}

// Scraper scrapes one upstream's metrics_url until stopped.
type Scraper struct {
	url    string
	client *fasthttp.Client
	now    func() time.Time
	state  atomic.Pointer[BackendState]
	stop   chan struct{}
	once   sync.Once
}

func NewScraper(url string, now func() time.Time) *Scraper {
	s := &Scraper{url: url, now: now, stop: make(chan struct{}),
		client: &fasthttp.Client{MaxResponseBodySize: maxScrapeBytes, ReadTimeout: scrapeTimeout, WriteTimeout: scrapeTimeout,
			MaxConnsPerHost: 1, NoDefaultUserAgentHeader: true}}
	return s
}

// Run scrapes every scrapeEvery until Close.
func (s *Scraper) Run() {
	t := time.NewTicker(scrapeEvery)
	defer t.Stop()
	for {
		s.scrape()
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
	}
}

func (s *Scraper) Close() { s.once.Do(func() { close(s.stop) }) }

// scrape reads the metrics once. The error said is tokentap's words only
// (never the server's bytes).
func (s *Scraper) scrape() {
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(s.url)
	req.Header.Set("Accept", "text/plain")
	st := &BackendState{Running: -1, Waiting: -1, KV: -1, At: s.now()}
	err := s.client.DoTimeout(req, resp, scrapeTimeout)
	switch {
	case err != nil:
		st.Err = "scrape failed: " + scrapeErr(err)
	case resp.StatusCode() != fasthttp.StatusOK:
		st.Err = "scrape answered " + strconv.Itoa(resp.StatusCode())
	default:
		parseBackendMetrics(resp.Body(), st)
		switch {
		case st.Running > maxBackendRequests || st.Waiting > maxBackendRequests:
			*st = BackendState{Running: -1, Waiting: -1, KV: -1, At: st.At, Err: "implausible request count in the scrape"}
		case st.Running < 0 && st.Waiting < 0 && st.KV < 0:
			st.Err = "no known metric in the scrape"
		}
	}
	metrics.BackendScrape(st.Err == "")
	s.state.Store(st)
}

// scrapeErr says what kind of failure err is, in tokentap's words.
func scrapeErr(err error) string {
	switch {
	case errors.Is(err, fasthttp.ErrBodyTooLarge):
		return "body over 4 MiB"
	case sock.IsTimeout(err):
		return "timed out"
	}
	return "cannot connect or read"
}

// State is the last scrape (nil: none yet).
func (s *Scraper) State() *BackendState { return s.state.Load() }

// fresh returns the last scrape when it answered within scrapeFresh.
func (s *Scraper) fresh(now time.Time) (*BackendState, bool) {
	if s == nil {
		return nil, false
	}
	st := s.state.Load()
	if st == nil || st.Err != "" || now.Sub(st.At) > scrapeFresh {
		return st, false
	}
	return st, true
}

// Others is how many requests the backend holds beyond tokentap's k in
// flight there (0 without a fresh scrape that says), at most k or
// minOthers.
func (s *Scraper) Others(now time.Time, k int) int {
	st, ok := s.fresh(now)
	if !ok || st.Running < 0 && st.Waiting < 0 {
		return 0
	}
	held := min(max(st.Running, 0)+max(st.Waiting, 0), maxBackendRequests)
	return min(max(0, int(math.Round(held))-k), max(k, minOthers))
}

// parseBackendMetrics reads the Prometheus text exposition in b: the sum
// over label sets of the running and waiting requests, the largest KV
// cache use. Lines it does not know are skipped.
func parseBackendMetrics(b []byte, st *BackendState) {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		line = bytes.TrimSpace(line)
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		end := bytes.IndexAny(line, "{ ")
		if end <= 0 {
			continue
		}
		name := line[:end]
		rest := line[end:]
		if rest[0] == '{' {
			j := bytes.LastIndexByte(rest, '}')
			if j < 0 {
				continue
			}
			rest = rest[j+1:]
		}
		fields := bytes.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(string(fields[0]), 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			continue
		}
		switch {
		case hasName(runningNames, name):
			st.Running = min(max(st.Running, 0)+v, 2*maxBackendRequests) // past the bound either way
		case hasName(waitingNames, name):
			st.Waiting = min(max(st.Waiting, 0)+v, 2*maxBackendRequests)
		case hasName(kvNames, name):
			st.KV = max(st.KV, min(v, 1))
		}
	}
}

func hasName(names [][]byte, name []byte) bool {
	for _, n := range names {
		if bytes.Equal(n, name) {
			return true
		}
	}
	return false
}
