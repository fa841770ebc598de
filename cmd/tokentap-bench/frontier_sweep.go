package main

// The frontier's rate sweep: each rate probed several times per arm,
// interleaved, with an A/A control for its noise band, and the frontier
// read off the probes.

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"
)

// aaControl is the name of the A/A control of the sweep: direct, measured
// again as if it were an arm. What it adds to direct is the instrument's
// own noise at that rate.
const aaControl = "direct A/A"

// sweep offers each rate in turn, f.probes times, to direct, the A/A
// control and every arm still going, interleaved in an order rotated each
// probe. An arm's point at a rate is the median of its probes' added p99s
// (each its p99 less direct's in the same probe); the rate's noise band is
// the control's median added p99, in absolute value. An arm stops at its
// second rate in a row past the largest limit (a rate whose band is itself
// past it counts for nothing), or at its first not held in most probes; all stop where direct itself is not
// held twice (the load generator's and the backend's ceiling).
func (f *frontierSettings) sweep(arms []*arm, r int) (map[string][]ratePoint, float64) {
	out := map[string][]ratePoint{}
	going, over := map[string]bool{}, map[string]bool{}
	for _, a := range arms {
		going[a.Name] = true
	}
	control := *arms[0]
	control.Name = aaControl
	all := append(slices.Clone(arms), &control)
	going[aaControl] = true
	lim := f.limits[len(f.limits)-1]
	capRate := 0.0
	for k, rate := range f.rates() {
		fmt.Fprintf(os.Stderr, "offered %.0f/s:", rate)
		// A p99 needs requests beyond it: at low rates the probe lasts
		// long enough for minProbeRequests.
		probe := max(f.probe, time.Duration(minProbeRequests/rate*float64(time.Second)))
		probes := f.probeRate(all, going, rate, probe, k, r, lim)
		band := math.Abs(median(addedOf(probes[aaControl])))
		pts := map[string]ratePoint{}
		for _, a := range all {
			ps := probes[a.Name]
			if len(ps) == 0 {
				continue
			}
			p := mergeProbes(ps)
			p.Band = band
			pts[a.Name] = p
			out[a.Name] = append(out[a.Name], p)
			if a.Name != "direct" {
				fmt.Fprintf(os.Stderr, " %s %+.2fms [%+.1f…%+.1f]", a.Name, p.Added, slices.Min(p.Probes), slices.Max(p.Probes))
			}
			// An arm stops at its second rate in a row past the largest
			// limit (one alone may still be noise; one where the control
			// itself is past it tells nothing), or at once when it fell
			// behind.
			switch {
			case a.Name == aaControl:
				// The control goes on as long as direct does.
			case !p.Held:
				going[a.Name] = false
			case p.Added > lim && band <= lim:
				if over[a.Name] {
					going[a.Name] = false
				}
				over[a.Name] = true
			default:
				over[a.Name] = false
			}
		}
		fmt.Fprintf(os.Stderr, " (band %.2fms)\n", band)
		if !pts["direct"].Held {
			break
		}
		capRate = rate
		if !slices.ContainsFunc(arms[1:], func(a *arm) bool { return going[a.Name] }) {
			break
		}
	}
	return out, capRate
}

// probeRate probes every arm still going at rate, f.probes times (fewer
// once direct no longer holds), each probe lasting probe, the arms in an
// order rotated by rate (k), round (r) and probe: each arm's figures, its
// added p99 against direct's in the same probe. A direct probe past the
// backend's time by more than lim is taken again once before it counts.
func (f *frontierSettings) probeRate(all []*arm, going map[string]bool, rate float64, probe time.Duration, k, r int, lim float64) map[string][]ratePoint {
	probes := map[string][]ratePoint{}
	directHeld := true
	for n := 0; n < f.probes && directHeld; n++ {
		retried := false
		order := rotate(all, k+r+n)
		direct := ratePoint{}
		got := map[string]ratePoint{}
		for i := 0; i < len(order); i++ {
			a := order[i]
			if !going[a.Name] {
				continue
			}
			p := f.probeAt(a, rate, probe, fmt.Sprintf("f-%s-%d-%.0f-%d-", strings.ReplaceAll(a.Name, " ", ""), r, rate, n))
			if a.Name == "direct" {
				// Past this the load generator or the backend is the
				// bottleneck: added figures would measure them. A
				// stall of either in one probe is not its ceiling:
				// direct is measured once more before the search ends.
				p.Held = p.Held && p.P99 <= ms(f.backend)+lim
				if !p.Held && !retried {
					retried = true
					fmt.Fprintf(os.Stderr, " direct p99 %.1fms, again", p.P99)
					i--
					continue
				}
				direct = p
			}
			got[a.Name] = p
		}
		for name, p := range got {
			if name != "direct" {
				p.Added = p.P99 - direct.P99
			}
			probes[name] = append(probes[name], p)
		}
		directHeld = direct.Held
	}
	return probes
}

// pinArms puts every arm's processes on the last CPU and this program and
// the backend (its pid; 0 or less: already placed) on the others: the load generator's work and its pauses
// never take the CPU an arm runs on, and every arm has the same one.
func (f *frontierSettings) pinArms(arms []*arm, backend int) error {
	last := runtime.NumCPU() - 1
	var others []int
	for c := range last {
		others = append(others, c)
	}
	own := []int{os.Getpid()}
	if backend > 0 {
		own = append(own, backend)
	}
	if err := pinTasks(own, others); err != nil {
		return err
	}
	for _, a := range arms {
		if a.pids == nil {
			continue
		}
		if err := pinTasks(a.pids(), []int{last}); err != nil {
			return fmt.Errorf("%s: %w", a.Name, err)
		}
	}
	return nil
}

// probeAt measures arm a once at rate for probe, after a warm-up of a
// fifth of f.probe. The load generator's garbage collector is held off
// while it measures (collected just before): its pauses are not the
// arm's.
func (f *frontierSettings) probeAt(a *arm, rate float64, probe time.Duration, id string) ratePoint {
	cl := f.client(a)
	warm, plan := smallPlan(a, cl, rate, f.probe/5, "wu-"), smallPlan(a, cl, rate, probe, id)
	warm.Burstiness, plan.Burstiness = f.burst, f.burst
	run(warm)
	runtime.GC()
	old := debug.SetGCPercent(-1)
	tr := f.traceDuring(a, rate, probe, id)
	st, _ := measure(a, plan)
	debug.SetGCPercent(old)
	tr()
	p := ratePoint{Offered: rate, Requests: st.Requests, Errors: st.Errors, P50: st.E2Ep50, P99: st.E2Ep99,
		Achieved: float64(st.Requests) / probe.Seconds()}
	// Held, and not behind: the last answers came within a second (and
	// half the probe) of the last arrival.
	p.Held = held(rate, probe, f.burst, st.Requests+st.Errors, p.Errors) && st.Seconds <= 1.5*probe.Seconds()+1
	return p
}

// traceDuring starts an execution trace of tokentap arm a for d when rate
// is within -trace and this is its first probe there (id ends "-0-"), and
// returns what waits for it to be written.
func (f *frontierSettings) traceDuring(a *arm, rate float64, d time.Duration, id string) func() {
	var lo, hi float64
	if f.trace == "" || a.Admin == "" || !strings.HasSuffix(id, "-0-") {
		return func() {}
	}
	if n, _ := fmt.Sscanf(f.trace, "%g-%g", &lo, &hi); n != 2 || rate < lo || rate > hi {
		return func() {}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		url := fmt.Sprintf("http://%s/debug/pprof/trace?seconds=%d", a.Admin, max(1, int(d.Seconds())))
		resp, err := http.Get(url)
		if err != nil {
			fmt.Fprintf(os.Stderr, " (trace: %v)", err)
			return
		}
		defer resp.Body.Close()
		path := filepath.Join(f.outDir, fmt.Sprintf("%s-%.0f.trace", strings.ReplaceAll(a.Name, " ", ""), rate))
		out, err := os.Create(path)
		if err == nil {
			_, err = io.Copy(out, resp.Body)
			out.Close()
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, " (trace: %v)", err)
		}
	}()
	return func() { <-done }
}

func addedOf(ps []ratePoint) []float64 {
	out := make([]float64, len(ps))
	for i, p := range ps {
		out[i] = p.Added
	}
	return out
}

// mergeProbes is an arm's point at a rate from its probes: the medians of
// its figures, each probe's added p99, held when most probes held.
func mergeProbes(ps []ratePoint) ratePoint {
	col := func(f func(ratePoint) float64) float64 {
		v := make([]float64, len(ps))
		for i, p := range ps {
			v[i] = f(p)
		}
		return median(v)
	}
	held := 0
	for _, p := range ps {
		if p.Held {
			held++
		}
	}
	return ratePoint{Offered: ps[0].Offered, Achieved: col(func(p ratePoint) float64 { return p.Achieved }),
		Requests: int(col(func(p ratePoint) float64 { return float64(p.Requests) })), Errors: int(col(func(p ratePoint) float64 { return float64(p.Errors) })),
		P50: col(func(p ratePoint) float64 { return p.P50 }), P99: col(func(p ratePoint) float64 { return p.P99 }),
		Added: col(func(p ratePoint) float64 { return p.Added }), Held: 2*held > len(ps), Probes: addedOf(ps)}
}

// held says whether n answers in d, errs of them errors, kept up with
// arrivals at rate whose gaps are gamma-distributed of shape (1: Poisson):
// no more than 0.1% errors, and no fewer answers than three standard
// deviations under the rate's mean (an arm that falls behind answers fewer
// within the window and the wait that ends it). Such a count's variance
// is its mean over the shape: bursts spread it.
func held(rate float64, d time.Duration, shape float64, n, errs int) bool {
	mean := rate * d.Seconds()
	return float64(n) >= mean-3*math.Sqrt(mean/shape)-1 && float64(errs) <= 0.001*float64(n)
}

func rotate(a []*arm, k int) []*arm {
	if len(a) == 0 {
		return nil
	}
	k %= len(a)
	return append(slices.Clone(a[k:]), a[:k]...)
}

// frontierOf is the highest offered rate of pts (in increasing order) that
// was held within limit ms before two rates in a row were not (a rate
// whose noise band, the A/A control's added p99, is itself past the limit
// is passed over: it cannot tell): a single
// rate past the limit between rates within it is taken for the noise of
// two p99s (the arm's and direct's), and is itself never the frontier.
// capped says the search ended at direct's ceiling (or the last rate
// tried) with the arm still within the limit: its frontier is at least
// the figure.
func frontierOf(pts []ratePoint, limit, directCap float64) (rate float64, capped bool) {
	bad := 0
	for _, p := range pts {
		if p.Offered > directCap {
			return rate, bad == 0
		}
		if p.Held && p.Band > limit {
			continue // the instrument's own noise at this rate is past the limit: it decides nothing
		}
		if !p.Held || p.Added > limit {
			if bad++; bad == 2 {
				return rate, false
			}
			continue
		}
		bad, rate = 0, p.Offered
	}
	return rate, bad == 0
}
