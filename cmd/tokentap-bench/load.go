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
	ru := &runner{p: p, cl: cl, seed: rand.Uint64()}
	ru.warmup()
	ru.counting.Store(true)
	start := time.Now()
	if p.Rate == 0 && len(p.Steps) == 0 {
		ru.closedLoop(start)
	} else {
		ru.openLoop()
	}
	ru.wg.Wait()
	return ru.results, time.Since(start), nil
}

// runner is one run of a plan: its requests sent, and the results of
// those counted (after the warm-up).
type runner struct {
	p        plan
	cl       *client
	seed     uint64
	seq      atomic.Int64
	errs     atomic.Int64
	counting atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	results  []result
}

// send sends the plan's next request and keeps its result once counting.
func (ru *runner) send(r *rand.Rand) {
	p := ru.p
	n := ru.seq.Add(1)
	w := p.Workloads[int(n)%len(p.Workloads)]
	id := fmt.Sprintf("%sb%x-%d", p.IDPrefix, ru.seed&0xffffff, n)
	res := ru.cl.do(id, body(w, p.Model, p.Stream, p.SharedPrefix, r), p.Stamped)
	res.Workload = w.Name
	if !ru.counting.Load() {
		return
	}
	if res.Err != "" || res.Status >= 400 {
		ru.errs.Add(1)
	}
	ru.mu.Lock()
	ru.results = append(ru.results, res)
	done := len(ru.results)
	ru.mu.Unlock()
	if p.Progress != nil {
		p.Progress(done, int(ru.errs.Load()))
	}
}

// warmup sends the plan's warm-up requests at its concurrency, not
// counted.
func (ru *runner) warmup() {
	p := ru.p
	if p.Warmup <= 0 {
		return
	}
	var wg sync.WaitGroup
	left := atomic.Int64{}
	left.Store(int64(p.Warmup))
	for range max(1, min(p.Concurrency, p.Warmup)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(rand.Uint64(), 1))
			for left.Add(-1) >= 0 {
				ru.send(r)
			}
		}()
	}
	wg.Wait()
}

// enough reports whether the run, started at start, has sent what its
// plan asks.
func (ru *runner) enough(start time.Time) bool {
	p := ru.p
	return p.Duration > 0 && time.Since(start) >= p.Duration || p.Requests > 0 && ru.seq.Load() >= int64(p.Warmup+p.Requests)
}

// closedLoop keeps the plan's concurrency of requests open until enough.
func (ru *runner) closedLoop(start time.Time) {
	for range max(1, ru.p.Concurrency) {
		ru.wg.Add(1)
		go func() {
			defer ru.wg.Done()
			r := rand.New(rand.NewPCG(rand.Uint64(), 2))
			for !ru.enough(start) {
				ru.send(r)
			}
		}()
	}
}

// openLoop sends arrivals at the plan's rate (or its steps' rates), gaps
// gamma-distributed, whatever the answers, with at most MaxInflight open.
func (ru *runner) openLoop() {
	p := ru.p
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
	for _, st := range steps {
		end := time.Now().Add(st.For)
		if st.For == 0 {
			end = time.Now().Add(24 * time.Hour)
		}
		for time.Now().Before(end) {
			if p.Requests > 0 && ru.seq.Load() >= int64(p.Warmup+p.Requests) {
				return
			}
			// Gamma gaps with mean 1/rate: shape 1 is Poisson, smaller is burstier.
			next = next.Add(time.Duration(gamma(r, shape) / (shape * st.Rate) * float64(time.Second)))
			time.Sleep(time.Until(next))
			inflight <- struct{}{}
			ru.wg.Add(1)
			go func(seed uint64) {
				defer ru.wg.Done()
				ru.send(rand.New(rand.NewPCG(seed, 4)))
				<-inflight
			}(r.Uint64())
		}
	}
}

// gamma draws from Gamma(shape, 1) (stats.Gamma: Marsaglia and Tsang).
func gamma(r *rand.Rand, shape float64) float64 { return stats.Gamma(r, shape) }
