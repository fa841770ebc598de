package measure

import (
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// How a stream read (docs/MEASUREMENT.md, "How the stream read"). A reader
// reads a token every pace V from the first token on and waits when the
// next has not come: with a_i the token's arrival,
//
//	r_0 = a_0;  w_i = max(0, a_i − (r_{i−1} + V));  r_i = max(r_{i−1} + V, a_i)
//
// stall = Σ w_i, stalls = the waits of at least V. The waits depend only on
// the tokens' times relative to each other, so the reader follows the
// stream as each delivery is stamped, whatever the client's clock adds to
// all of them; what depends on the request's start (the first token due T
// after it: fluidity and the QoE score) is derived at the end, once the
// client's time to first token is known (Tap.FillReading).

// Pace is what a stream is read against: its first token due TTFT after
// the request's start, then a token every Read.
type Pace struct {
	TTFT, Read time.Duration
}

// DefaultPace is the pace of a route with no objective and no qoe key: a
// first token within a second, then a token every 50 ms (20 a second,
// about a fast reader's pace at a token per word and a half).
var DefaultPace = Pace{TTFT: time.Second, Read: 50 * time.Millisecond}

// Over returns p with each time that o sets taken from o.
func (p Pace) Over(o Pace) Pace {
	if o.TTFT > 0 {
		p.TTFT = o.TTFT
	}
	if o.Read > 0 {
		p.Read = o.Read
	}
	return p
}

// reader is the reader model of one stream, followed delivery by delivery
// in tokentap's frame: times are relative to the first token's delivery.
type reader struct {
	pace  Pace
	first int64         // the first token's delivery (a_0 in tokentap's frame), Unix ns
	end   time.Duration // r_i − a_0
	stall time.Duration // Σ w_i
	worst time.Duration // the longest wait
	// When the bytes of the token events not yet delivered were read
	// (Unix ns), and the client's stall when the last delivery went out.
	readAt    int64
	stallLast time.Duration
	tokens    int32
	stalls    int32
	held      metrics.Hop // the hop behind the longest wait
}

// start readies r for a stream read at p (a zero time: DefaultPace's).
func (r *reader) start(p Pace) { *r = reader{pace: DefaultPace.Over(p)} }

// read notes that bytes carrying a token were read at t; the first read
// since the last delivery stands for the tokens it delivers.
func (r *reader) read(t time.Time, pending int) {
	if pending == 0 {
		r.readAt = t.UnixNano()
	}
}

// deliver steps the reader over k tokens delivered at t, when the client's
// writes had waited stall in all: what they waited since the last tokens
// delivered held these (writes of bytes before them included).
func (r *reader) deliver(t time.Time, k int, stall time.Duration) {
	if k == 0 {
		return // the client's wait counts toward the next tokens delivered
	}
	client := max(stall-r.stallLast, 0)
	r.stallLast = stall
	now := t.UnixNano()
	if r.tokens == 0 {
		r.first, r.tokens, k = now, 1, k-1
		if k == 0 {
			return
		}
	}
	// Only the first of tokens delivered together can wait: the reader
	// reads the others a pace apart after it.
	r.tokens += int32(k)
	x, due := time.Duration(now-r.first), r.end+r.pace.Read
	r.end = max(x, due) + time.Duration(k-1)*r.pace.Read
	if w := x - due; w > 0 {
		r.stall += w
		if w >= r.pace.Read {
			r.stalls++
		}
		if w > r.worst {
			r.worst, r.held = w, blame(w, client, time.Duration(now-r.readAt)-client)
		}
	}
}

// blame is the hop that held a token behind a wait of w, when the
// client's side held its bytes client (its writes waited) and tokentap
// gateway (from their read to their write, the client's wait aside). The
// wait is laid on the hops from the reader's end back: the client's part,
// then tokentap's, and the upstream the rest; the largest part is to
// blame.
func blame(w, client, gateway time.Duration) metrics.Hop {
	c := min(max(client, 0), w)
	g := min(max(gateway, 0), w-c)
	u := w - c - g
	switch {
	case u >= g && u >= c:
		return metrics.HopUpstream
	case g >= c:
		return metrics.HopGateway
	}
	return metrics.HopClient
}

// fill fills rd with the reading of a stream whose first token reached
// the reader ttft after the request's start, its tokens spaced as gaps
// (in order; fewer than the tokens when the record kept only the first
// of them: fluidity is then over those).
func (r *reader) fill(rd *metrics.Reading, ttft time.Duration, gaps []time.Duration) {
	if r.tokens == 0 || ttft < 0 {
		return
	}
	n, p := int(r.tokens), r.pace
	rd.Tokens, rd.Stall, rd.Stalls, rd.HeldBy = n, r.stall, int(r.stalls), r.held
	// The reader ends r_{n−1} − s = ttft + r.end after the start.
	expected := p.TTFT + time.Duration(n-1)*p.Read
	rd.QoE = min(1, float64(expected)/float64(max(ttft+r.end, 1)))
	rd.Fluidity = fluidity(p, ttft, gaps)
}

// fluidity is the share of tokens that came by their deadline: the first
// due T after the start; each next one V after the last deadline while
// the token before met it, else V after that token came. The tokens come
// ttft after the start, then spaced by gaps.
func fluidity(p Pace, ttft time.Duration, gaps []time.Duration) float64 {
	var a time.Duration = ttft // a_i − s
	d := p.TTFT                // d_i − s
	on := 0
	if a <= d {
		on++
	}
	for _, g := range gaps {
		if a <= d {
			d += p.Read
		} else {
			d = a + p.Read
		}
		a += g
		if a <= d {
			on++
		}
	}
	return float64(on) / float64(len(gaps)+1)
}

// ReadingOf is the reader model over token arrivals known whole, each
// relative to the request's start (a client's own clock: tokentap-bench,
// and the tests that check tokentap's), straight from its definition; p's
// zero times are DefaultPace's. HeldBy is left out: a client cannot tell.
func ReadingOf(a []time.Duration, p Pace) metrics.Reading {
	n := len(a)
	if n == 0 {
		return metrics.Reading{}
	}
	p = DefaultPace.Over(p)
	T, V := p.TTFT, p.Read
	rd := metrics.Reading{Tokens: n}
	r := a[0]
	for i := 1; i < n; i++ {
		w := max(0, a[i]-(r+V))
		r = max(r+V, a[i])
		rd.Stall += w
		if w >= V {
			rd.Stalls++
		}
	}
	d, on := T, 0
	for i := range n {
		if i > 0 {
			if a[i-1] <= d {
				d += V
			} else {
				d = a[i-1] + V
			}
		}
		if a[i] <= d {
			on++
		}
	}
	rd.Fluidity = float64(on) / float64(n)
	rd.QoE = min(1, float64(T+time.Duration(n-1)*V)/float64(max(r, 1)))
	return rd
}
