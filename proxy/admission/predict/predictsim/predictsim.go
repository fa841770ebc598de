// Package predictsim simulates an inference server whose truth the tests
// of overload control know: Slots requests served at once (the batch),
// the others waiting in order; a request's prefill of Base plus PerToken
// per input token, then Out tokens each a Gap that grows with the batch
// (Gap × (1 + 0.1·(batch−1))), everything slowed by Slow(t). Time is the
// simulation's: a request's fate is known the moment it arrives, so a
// test runs minutes of load in milliseconds, on no clock but its own.
package predictsim

import (
	"container/heap"
	"math/rand/v2"
	"slices"
	"time"
)

// Backend is the simulated server. Requests arrive in time order.
type Backend struct {
	Slots          int
	Base, PerToken time.Duration
	Gap            time.Duration
	Out            int
	// Slow is the factor the server is slowed by at t (nil: 1).
	Slow func(t time.Duration) float64
	// InLow and InHigh bound the input tokens of Arrivals' requests.
	InLow, InHigh int
	Rng           *rand.Rand

	free      durations // when each busy slot frees
	inSystem  durations // completions of the requests in the system
	completed []Request
}

// Request is a simulated request: it arrived at Arrived with K others in
// the system and In input tokens, got its first token TTFT later, then a
// token every TPOT, and completed At.
type Request struct {
	Arrived, At, TTFT, TPOT time.Duration
	K, In                   int
}

type durations []time.Duration

func (h durations) Len() int           { return len(h) }
func (h durations) Less(i, j int) bool { return h[i] < h[j] }
func (h durations) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *durations) Push(x any)        { *h = append(*h, x.(time.Duration)) }
func (h *durations) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// New is the server of the overload tests: 8 slots, 20 ms of prefill and
// 0.05 ms per input token (100 to 2,000 of them), 32 output tokens 6 ms
// apart alone and 10.2 ms at a full batch.
func New(seed uint64) *Backend {
	return &Backend{Slots: 8, Base: 20 * time.Millisecond, PerToken: 50 * time.Microsecond, Gap: 6 * time.Millisecond, Out: 32,
		Rng: rand.New(rand.NewPCG(seed, 1)), InLow: 100, InHigh: 2000}
}

// InSystem is the number of requests in the system at a: in flight, as a
// gateway in front of it counts them.
func (b *Backend) InSystem(a time.Duration) int {
	for b.inSystem.Len() > 0 && b.inSystem[0] <= a {
		heap.Pop(&b.inSystem)
	}
	return b.inSystem.Len()
}

// Input draws a request's input tokens.
func (b *Backend) Input() int { return b.InLow + b.Rng.IntN(b.InHigh-b.InLow+1) }

// Arrive sends one request of in input tokens at a and returns its fate.
func (b *Backend) Arrive(a time.Duration, in int) Request {
	k := b.InSystem(a)
	start := a
	if b.free.Len() == b.Slots {
		start = max(a, heap.Pop(&b.free).(time.Duration))
	}
	for b.free.Len() > 0 && b.free[0] <= start {
		heap.Pop(&b.free) // slots already free by then
	}
	batch := b.free.Len() + 1
	s := 1.0
	if b.Slow != nil {
		s = b.Slow(start)
	}
	prefill := time.Duration(float64(b.Base+time.Duration(in)*b.PerToken) * s)
	gap := time.Duration(float64(b.Gap) * (1 + 0.1*float64(batch-1)) * s)
	done := start + prefill + time.Duration(b.Out-1)*gap
	heap.Push(&b.free, done)
	heap.Push(&b.inSystem, done)
	r := Request{Arrived: a, At: done, TTFT: start - a + prefill, TPOT: gap, K: k, In: in}
	b.completed = append(b.completed, r)
	return r
}

// Run sends Poisson arrivals at rate(t) a second from 0 to end, every one
// served, and returns them in the order they completed.
func (b *Backend) Run(end time.Duration, rate func(t time.Duration) float64) []Request {
	for t := time.Duration(0); t < end; {
		t += time.Duration(b.Rng.ExpFloat64() / rate(t) * float64(time.Second))
		b.Arrive(t, b.Input())
	}
	out := slices.Clone(b.completed)
	slices.SortFunc(out, func(x, y Request) int { return int(x.At - y.At) })
	return out
}

// Capacity is the server's requests a second at a full batch, for
// requests of the mean input size.
func (b *Backend) Capacity() float64 {
	in := float64(b.InLow+b.InHigh) / 2
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return float64(b.Slots) / (ms(b.Base) + in*ms(b.PerToken) + float64(b.Out-1)*ms(b.Gap)*(1+0.1*float64(b.Slots-1))) * 1000
}

// Bursts is a load of 5 s at high times capacity, then 5 s at low: the
// queue builds and drains, and every level up to a few dozen is seen
// again and again.
func Bursts(capacity, high, low float64) func(time.Duration) float64 {
	return func(t time.Duration) float64 {
		if (t/(5*time.Second))%2 == 0 {
			return high * capacity
		}
		return low * capacity
	}
}
