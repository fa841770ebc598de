package main

import (
	"crypto/tls"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tokentap/tokentap/metrics/stats"
)

// plan is one load to apply.
type plan struct {
	URL          string
	TLS          *tls.Config // for an https:// URL (nil: the system's roots)
	Model        string
	Workloads    []workload
	Stream       bool
	SharedPrefix bool
	Stamped      bool
	Headers      map[string]string
	Timeout      time.Duration

	// Closed loop: Concurrency workers, each sending its next request when
	// the last one ended. Open loop: arrivals at Rate per second (gamma
	// distributed gaps of shape Burstiness; 1 is Poisson), or Steps.
	Concurrency int
	Rate        float64
	Burstiness  float64
	Steps       []step
	// MaxInflight bounds the open requests of the open loop (default
	// 20000): an arm that falls behind holds up the arrivals instead of
	// the load generator's descriptors.
	MaxInflight int

	Warmup   int           // requests sent first and not counted
	Requests int           // counted requests (0: until Duration)
	Duration time.Duration // counted time (0: until Requests)
	Progress func(done, errors int)
	IDPrefix string
	// Client, when set, is used (and kept open) instead of a new one, so
	// that connections live across runs.
	Client *client
}

type step struct {
	Rate float64
	For  time.Duration
}

func parseSteps(s string) ([]step, error) {
	var out []step
	for _, part := range strings.Split(s, ",") {
		r, d, ok := strings.Cut(part, ":")
		rate, err1 := strconv.ParseFloat(r, 64)
		dur, err2 := time.ParseDuration(d)
		if !ok || err1 != nil || err2 != nil || rate <= 0 || dur <= 0 {
			return nil, fmt.Errorf("-steps: %q is not rate:duration (e.g. 5:10s)", part)
		}
		out = append(out, step{rate, dur})
	}
	return out, nil
}

// run applies the plan and returns the counted results and their wall time.
func run(p plan) ([]result, time.Duration, error) {
	cl := p.Client
	if cl == nil {
		var err error
		if cl, err = newClient(p.URL, p.Headers, p.Timeout, p.TLS); err != nil {
			return nil, 0, err
		}
		defer cl.closeIdle()
	}
	seed := rand.Uint64()
	var seq atomic.Int64
	var mu sync.Mutex
	var results []result
	var errs atomic.Int64
	counting := atomic.Bool{}
	send := func(r *rand.Rand) {
		n := seq.Add(1)
		w := p.Workloads[int(n)%len(p.Workloads)]
		id := fmt.Sprintf("%sb%x-%d", p.IDPrefix, seed&0xffffff, n)
		res := cl.do(id, body(w, p.Model, p.Stream, p.SharedPrefix, r), p.Stamped)
		res.Workload = w.Name
		if !counting.Load() {
			return
		}
		if res.Err != "" || res.Status >= 400 {
			errs.Add(1)
		}
		mu.Lock()
		results = append(results, res)
		done := len(results)
		mu.Unlock()
		if p.Progress != nil {
			p.Progress(done, int(errs.Load()))
		}
	}
	// Warm-up: a few requests at the plan's concurrency, not counted.
	if p.Warmup > 0 {
		var wg sync.WaitGroup
		left := atomic.Int64{}
		left.Store(int64(p.Warmup))
		for range max(1, min(p.Concurrency, p.Warmup)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(rand.Uint64(), 1))
				for left.Add(-1) >= 0 {
					send(r)
				}
			}()
		}
		wg.Wait()
	}
	counting.Store(true)
	start := time.Now()
	enough := func() bool {
		if p.Duration > 0 && time.Since(start) >= p.Duration {
			return true
		}
		if p.Requests > 0 && seq.Load() >= int64(p.Warmup+p.Requests) {
			return true
		}
		return false
	}
	var wg sync.WaitGroup
	if p.Rate == 0 && len(p.Steps) == 0 {
		for range max(1, p.Concurrency) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(rand.Uint64(), 2))
				for !enough() {
					send(r)
				}
			}()
		}
	} else {
		steps := p.Steps
		if len(steps) == 0 {
			steps = []step{{p.Rate, p.Duration}}
		}
		shape := p.Burstiness
		if shape <= 0 {
			shape = 1
		}
		r := rand.New(rand.NewPCG(rand.Uint64(), 3))
		next := time.Now()
		maxOpen := p.MaxInflight
		if maxOpen <= 0 {
			maxOpen = 20000
		}
		inflight := make(chan struct{}, maxOpen) // a bound on open requests: past it arrivals wait
	stepsLoop:
		for _, st := range steps {
			end := time.Now().Add(st.For)
			if st.For == 0 {
				end = time.Now().Add(24 * time.Hour)
			}
			for time.Now().Before(end) {
				if p.Requests > 0 && seq.Load() >= int64(p.Warmup+p.Requests) {
					break stepsLoop
				}
				// Gamma gaps with mean 1/rate: shape 1 is Poisson, smaller is burstier.
				next = next.Add(time.Duration(gamma(r, shape) / (shape * st.Rate) * float64(time.Second)))
				time.Sleep(time.Until(next))
				inflight <- struct{}{}
				wg.Add(1)
				go func(seed uint64) {
					defer wg.Done()
					send(rand.New(rand.NewPCG(seed, 4)))
					<-inflight
				}(r.Uint64())
			}
		}
	}
	wg.Wait()
	return results, time.Since(start), nil
}

// gamma draws from Gamma(shape, 1) (stats.Gamma: Marsaglia and Tsang).
func gamma(r *rand.Rand, shape float64) float64 { return stats.Gamma(r, shape) }
