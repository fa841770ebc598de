package relayplane

import (
	"runtime"
	rtmetrics "runtime/metrics"
	"time"
)

// A loop is one goroutine carrying the events of thousands of streams, and
// the runtime's scheduler knows it only as one goroutine among many. While
// few goroutines are runnable that costs nothing. When thousands of
// requests start at once, it costs the loop's streams their tokens: a
// goroutine the runtime's poller finds ready (sysmon's look, every 10 ms
// on a busy processor) or one that yields (runtime.Gosched) goes to the
// back of the global run queue, behind every request's goroutine, and
// waited there up to 194 ms a turn at 2,048 streams started at once on one
// processor (an execution trace), where a stream's own goroutine waits for
// its one turn only.
//
// A goroutine a timer readies goes instead to its processor's next slot
// (runnext), ahead of the queue: so does one woken by its file's read
// deadline. The loop therefore reads how many goroutines are runnable
// (runtime/metrics, 60 ns) as it parks or yields, and picks how to:
//   - calm: park on the runtime's poller, as any socket's reader does;
//     yield with runtime.Gosched;
//   - busy: park on the poller with the file's deadline at most pollEvery
//     ahead, so that a loop the poller found late is woken by the
//     deadline's timer instead;
//   - crowded: park on a timer for pollEvery (then look at the epoll set
//     without waiting) and yield with a sleep of yieldFor, which lets the
//     goroutine at the head of the queue run once before the loop.
//
// The loop then waits for about one other goroutine's turn, not the whole
// queue's, which is what the streams already under way need: a request
// waiting to start is delayed by the loop's own work only, a stream's
// events never by every request's start.
type crowding uint8

const (
	calm crowding = iota
	busy
	crowded
)

// The levels, in runnable goroutines a processor: at 8 the queue holds
// about half a millisecond of other goroutines' turns, at 64 some
// milliseconds.
const (
	busyAt    = 8
	crowdedAt = 64
	// pollEvery bounds how long a busy or crowded loop can go unserved
	// while its processor runs others.
	pollEvery = time.Millisecond
	// yieldFor is a crowded loop's yield after a full batch: more than a
	// pass of the scheduler, so that another goroutine runs first.
	yieldFor = 50 * time.Microsecond
)

// pacing is how a loop parks and yields: the scheduler's crowding at its
// last look (look), and the deadline a busy loop's file holds (pollAt;
// zero: none).
type pacing struct {
	crowd   crowding
	pollAt  time.Time
	samples [2]rtmetrics.Sample
}

func newPacing() pacing {
	var s pacing
	s.samples[0].Name = "/sched/goroutines/runnable:goroutines"
	s.samples[1].Name = "/sched/gomaxprocs:threads"
	return s
}

// look reads the scheduler's crowding now into crowd.
func (s *pacing) look() {
	s.crowd = s.level()
}

// parks reports whether a loop with nothing ready parks on the poller as
// it is: calm, or busy with its poll deadline set. Crowded, run sleeps
// instead (rest); busy without a deadline, run sets one (poll).
func (s *pacing) parks() bool {
	return s.crowd == calm || s.crowd == busy && !s.pollAt.IsZero()
}

// rest is run's pause between turns: after a full batch (more) a yield,
// a sleep of yieldFor when crowded; else, crowded, a sleep of pollEvery
// in place of parking on the poller.
func (s *pacing) rest(more bool) {
	switch {
	case more && s.crowd == crowded:
		time.Sleep(yieldFor)
	case more:
		runtime.Gosched()
	case s.crowd == crowded:
		time.Sleep(pollEvery)
	}
}

// poll is the deadline the loop's file should hold at now for a busy
// loop (zero: none): the one it holds until it passes, then one
// pollEvery ahead.
func (s *pacing) poll(now time.Time) time.Time {
	switch {
	case s.crowd != busy:
		return time.Time{}
	case s.pollAt.IsZero() || !now.Before(s.pollAt):
		return now.Add(pollEvery)
	}
	return s.pollAt
}

// level reads the runtime's count of runnable goroutines and its
// processors (without allocating): the crowding now.
func (s *pacing) level() crowding {
	rtmetrics.Read(s.samples[:])
	if s.samples[0].Value.Kind() != rtmetrics.KindUint64 || s.samples[1].Value.Kind() != rtmetrics.KindUint64 {
		return calm // a runtime without the metrics
	}
	return crowdingOf(s.samples[0].Value.Uint64(), s.samples[1].Value.Uint64())
}

// crowdingOf is the crowding of runnable goroutines on procs processors.
func crowdingOf(runnable, procs uint64) crowding {
	procs = max(procs, 1)
	switch {
	case runnable >= crowdedAt*procs:
		return crowded
	case runnable >= busyAt*procs:
		return busy
	}
	return calm
}
