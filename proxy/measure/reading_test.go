package measure

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/sse/dialect"
)

// readThrough has a meter measure tokens arriving at a (relative to the
// request's start, each delivered as it is read) and returns its reading.
func readThrough(a []time.Duration, p Pace) metrics.Reading {
	var m meter
	base := time.Unix(1_700_000_000, 0)
	m.reset(base)
	m.rd.start(p)
	for _, t := range a {
		m.read(base.Add(t))
		m.observe(dialect.Obs{Token: true}, base.Add(t))
		m.wrote(base.Add(t))
	}
	var rec metrics.Record
	rec.Reset()
	m.fill(&rec, base.Add(a[len(a)-1]), true)
	m.finish(&rec, true)
	return rec.Reading
}

// every returns n arrivals, the first at first, then gap apart.
func every(n int, first, gap time.Duration) []time.Duration {
	a := make([]time.Duration, n)
	for i := range a {
		a[i] = first + time.Duration(i)*gap
	}
	return a
}

func ms(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// TestReadingMatchesItsDefinition: the meter's reading, followed delivery
// by delivery, equals the formulas computed over the whole stream, in the
// shapes a reader tells apart, and over random streams.
func TestReadingMatchesItsDefinition(t *testing.T) {
	p := Pace{TTFT: time.Second, Read: 50 * time.Millisecond}
	long := every(40, 200*time.Millisecond, 20*time.Millisecond)
	for i := 20; i < len(long); i++ {
		long[i] += 2 * time.Second // one long stall after token 19
	}
	burst := []time.Duration{}
	for b := range 5 { // 10 tokens at once every 600 ms
		for range 10 {
			burst = append(burst, ms(300+600*float64(b)))
		}
	}
	starve := append(every(30, 100*time.Millisecond, time.Millisecond), every(10, 2*time.Second, 200*time.Millisecond)...)
	cases := []struct {
		name     string
		a        []time.Duration
		qoe1     bool // the reader finished by the expected timeline
		stalls   int  // -1: not checked here
		fluidity float64
	}{
		{"smooth", every(50, 300*time.Millisecond, 20*time.Millisecond), true, 0, 1},
		{"one long stall", long, false, 1, -1},
		{"late first token", every(20, 3*time.Second, 20*time.Millisecond), false, 0, -1},
		{"every gap over the pace", every(20, 100*time.Millisecond, 120*time.Millisecond), false, 19, -1},
		{"bursts", burst, true, 4, -1}, // the reader waits 100 ms a burst, within its slack
		{"early burst then starving", starve, false, -1, -1},
	}
	for _, c := range cases {
		got, want := readThrough(c.a, p), ReadingOf(c.a, p)
		if got.Tokens != want.Tokens || got.Stalls != want.Stalls || got.Stall != want.Stall ||
			math.Abs(got.QoE-want.QoE) > 1e-9 || math.Abs(got.Fluidity-want.Fluidity) > 1e-9 {
			t.Errorf("%s: got %+v, want %+v", c.name, got, want)
		}
		if (got.QoE == 1) != c.qoe1 {
			t.Errorf("%s: qoe %.3f", c.name, got.QoE)
		}
		if c.stalls >= 0 && got.Stalls != c.stalls {
			t.Errorf("%s: %d stalls, want %d", c.name, got.Stalls, c.stalls)
		}
		if c.fluidity >= 0 && got.Fluidity != c.fluidity {
			t.Errorf("%s: fluidity %.3f, want %.3f", c.name, got.Fluidity, c.fluidity)
		}
		if (got.HeldBy == metrics.HopNone) != (got.Stall == 0) {
			t.Errorf("%s: held by %q with a stall of %v", c.name, got.HeldBy, got.Stall)
		}
		if got.Stall > 0 && got.HeldBy != metrics.HopUpstream {
			t.Errorf("%s: held by %q, want upstream (read late, written at once)", c.name, got.HeldBy)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		n := 1 + rng.IntN(200)
		a := make([]time.Duration, n)
		t0 := time.Duration(rng.Int64N(int64(3 * time.Second)))
		for i := range a {
			a[i] = t0
			switch rng.IntN(4) {
			case 0: // with the one before
			case 1:
				t0 += time.Duration(rng.Int64N(int64(40 * time.Millisecond)))
			case 2:
				t0 += time.Duration(rng.Int64N(int64(120 * time.Millisecond)))
			default:
				t0 += time.Duration(rng.Int64N(int64(time.Second)))
			}
		}
		p := Pace{TTFT: time.Duration(1+rng.IntN(2000)) * time.Millisecond, Read: time.Duration(1+rng.IntN(100)) * time.Millisecond}
		got, want := readThrough(a, p), ReadingOf(a, p)
		if got.Tokens != want.Tokens || got.Stalls != want.Stalls || got.Stall != want.Stall ||
			math.Abs(got.QoE-want.QoE) > 1e-9 || math.Abs(got.Fluidity-want.Fluidity) > 1e-9 {
			t.Fatalf("pace %+v, arrivals %v:\ngot  %+v\nwant %+v", p, a, got, want)
		}
	}
}

// TestReadingWorkedExample is docs/MEASUREMENT.md's worked example.
func TestReadingWorkedExample(t *testing.T) {
	p := Pace{TTFT: time.Second, Read: 50 * time.Millisecond}
	a := []time.Duration{ms(400), ms(420), ms(440), ms(700), ms(710), ms(720)}
	got := readThrough(a, p)
	want := metrics.Reading{Tokens: 6, QoE: 1, Fluidity: 1, Stall: ms(150), Stalls: 1, HeldBy: metrics.HopUpstream}
	if got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	late := []time.Duration{ms(1200), ms(1250), ms(1300), ms(1600), ms(1650), ms(1700)}
	got = readThrough(late, p)
	// r: 1200, 1250, 1300, 1600 (waited 250), 1650, 1700; expected end
	// 1000 + 5·50 = 1250 ms: qoe = 1250/1700. Deadlines: 1000 (missed),
	// 1250 (1250: met), 1300 (met), 1350 (1600: missed), 1650, 1700.
	if got.Stall != ms(250) || got.Stalls != 1 || math.Abs(got.QoE-1250.0/1700) > 1e-9 || math.Abs(got.Fluidity-4.0/6) > 1e-9 {
		t.Fatalf("late first token: got %+v", got)
	}
}

// TestReadingBlamesTheHopThatHeld: a token read late is the upstream's;
// one read in time and written late tokentap's; one whose write waited
// for the client the client's.
func TestReadingBlamesTheHopThatHeld(t *testing.T) {
	base := time.Unix(1_700_000_000, 0)
	run := func(read, wrote []time.Duration, stall []time.Duration) metrics.Reading {
		var m meter
		m.reset(base)
		m.rd.start(Pace{TTFT: time.Second, Read: 50 * time.Millisecond})
		for i := range read {
			m.read(base.Add(read[i]))
			m.observe(dialect.Obs{Token: true}, base.Add(read[i]))
			m.stall = stall[i]
			m.wrote(base.Add(wrote[i]))
		}
		var rec metrics.Record
		rec.Reset()
		m.fill(&rec, base.Add(wrote[len(wrote)-1]), true)
		m.finish(&rec, true)
		return rec.Reading
	}
	at := []time.Duration{ms(100), ms(120), ms(140), ms(160)}
	none := make([]time.Duration, 4)
	// The third token read 400 ms late, written at once.
	up := []time.Duration{ms(100), ms(120), ms(540), ms(560)}
	if rd := run(up, up, none); rd.HeldBy != metrics.HopUpstream {
		t.Errorf("read late: held by %q", rd.HeldBy)
	}
	// Read in time, written 400 ms after.
	gw := []time.Duration{ms(100), ms(120), ms(540), ms(545)}
	if rd := run(at, gw, none); rd.HeldBy != metrics.HopGateway || rd.Stall < ms(300) {
		t.Errorf("written late: %+v", rd)
	}
	// Read in time, its write waiting 400 ms for the client.
	if rd := run(at, gw, []time.Duration{0, 0, ms(398), ms(398)}); rd.HeldBy != metrics.HopClient {
		t.Errorf("the client slow: %+v", rd)
	}
	// Read 150 ms late and held 300 ms more by tokentap: tokentap's.
	late := []time.Duration{ms(100), ms(120), ms(290), ms(300)}
	if rd := run(late, []time.Duration{ms(100), ms(120), ms(590), ms(595)}, none); rd.HeldBy != metrics.HopGateway {
		t.Errorf("read late, held longer: %+v", rd)
	}
}

// BenchmarkReaderPerToken is the reader model's cost on each token
// delivered: no allocation.
func BenchmarkReaderPerToken(b *testing.B) {
	var r reader
	r.start(Pace{})
	base := time.Unix(1_700_000_000, 0)
	b.ReportAllocs()
	for i := range b.N {
		t := base.Add(time.Duration(i) * 30 * time.Millisecond)
		r.read(t, 0)
		r.deliver(t, 1, 0)
	}
}
