package measure

import (
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/sock"
)

// The client's acknowledgement of a token. client_ttft_ms estimated as
// ttft_ms + RTT misses what the path added beyond its minimum: a queue on
// the way to the client (a bottleneck that other streams fill), a segment
// lost and sent again. The client's kernel acknowledges the bytes that
// carried the first token when they reach it, and the acknowledgement
// travels back the way the request came, so
//
//	client TTFT ≈ the acknowledgement's arrival − the request's arrival
//
// (the request's way in and the acknowledgement's way back cancel, as far
// as the path is the same both times). A mark watches for that
// acknowledgement on the client connection's TCP_INFO (tcpi_bytes_acked)
// after the write that carried the token: looks every lookEvery at most
// from a little before a round trip has passed (none within AckAgree of
// it, where what a look finds changes nothing), then every lookLater
// once a round trip and 10 ms passed (a queue on the path, or a client
// that delays its acknowledgements), until the bytes are acknowledged or
// a round trip and ackGiveUp passed.
//
// An acknowledgement found is read by reading: one that also covers
// bytes written after the token's may be the client acknowledging the
// later ones (a receiver delays its ACK until a second segment comes, or
// its timer runs out), and one of the token's bytes alone may be that
// timer's. Without a usable acknowledgement the estimate stays ttft_ms +
// RTT (byAck decides between the two).
type ackMark struct {
	mu     sync.Mutex // held by the watch during a look, and by the record to end it
	sys    syscall.RawConn
	target int64     // tcpi_bytes_acked once the token's bytes are acknowledged
	flush  time.Time // when the write that carried them returned
	rtt    time.Duration
	every  time.Duration
	// later is when the next bytes were written after the token's (Unix
	// ns, 0: none yet), and laterEnd tcpi_bytes_acked once they are
	// acknowledged: the response's goroutine sets them, laterEnd first.
	later    atomic.Int64
	laterEnd atomic.Int64
	next     time.Time // the next look
	prev     time.Time // the last look that found them unacknowledged
	until    time.Time // no look after it

	over bool // the watch is done: seen, given up, or the record took it
	// lagged: the client may hold its acknowledgement of a lone segment
	// (delayed): the connection carried a response before this one, and
	// the write that carried the token did not go out as two segments
	// nor follow one the client held (ClientSide.SplitFirst), which such
	// a client acknowledges as it reads them.
	lagged bool
	// ackedAt is when the bytes were acknowledged, the middle of the last
	// two looks, where that is usable (zero: none usable).
	ackedAt time.Time
}

// lookEvery bounds the time between two looks at a mark while its
// acknowledgement is due, and lookLater after: half of it is the
// estimate's own error. lookFirst is the shortest: a twentieth of the
// round trip on a long path, never below a quarter of AckAgree, within
// which the estimate by the round trip is taken anyway (byAck). Each look
// is a system call and most a wake-up of the marks' goroutine.
const (
	lookFirst = AckAgree / 4
	lookEvery = 500 * time.Microsecond
	lookLater = time.Millisecond
)

// ackGiveUp is how long after a round trip a mark is watched: a queue
// that holds a token longer is not measured (the estimate stays ttft_ms
// + RTT).
const ackGiveUp = 250 * time.Millisecond

// newAckMark watches for the acknowledgement of the first target bytes of
// the connection (tcpi_bytes_acked's count), written by flush, on a path
// whose round trip is about rtt.
func newAckMark(sys syscall.RawConn, target int64, flush time.Time, rtt time.Duration) *ackMark {
	m := &ackMark{sys: sys, target: target, flush: flush, rtt: rtt}
	m.every = min(max(rtt/20, lookFirst), lookEvery)
	// No acknowledgement can come before a round trip: look first a
	// little before one.
	m.prev = flush
	m.next = m.pastAgreed(flush.Add(rtt * 3 / 4))
	m.until = flush.Add(rtt + ackGiveUp)
	return m
}

// pastAgreed moves a look due within AckAgree of the round trip's
// estimate (flush + rtt) to that span's end. An acknowledgement found by
// then changes nothing: byAck takes the estimate for one that came within
// AckAgree of it, and the looks' middle (ackedAt) errs by half their gap
// at most, as anywhere. So on a short path (a client in the same network,
// loopback) the first look is at a round trip and AckAgree, where looks
// every lookFirst from three quarters of a round trip made 5 in that span
// for a client that delays its acknowledgement (as kept-alive HTTP
// clients do). The move never takes a look past 2 lookLater after the
// last, the longest gap whose middle is usable.
func (m *ackMark) pastAgreed(next time.Time) time.Time {
	est := m.est()
	end := est.Add(AckAgree)
	if !next.After(est.Add(-AckAgree)) || !next.Before(end) {
		return next
	}
	if most := m.prev.Add(2 * lookLater); most.Before(end) {
		end = most
	}
	if end.Before(next) {
		return next
	}
	return end
}

// look reads TCP_INFO once at now, into ti (the watch's buffer, shared by
// every mark it looks at: a mark holds none of its own while it waits); it
// reports whether the watch is over. The watch's goroutine calls it with
// m.mu held.
func (m *ackMark) look(now time.Time, ti *sock.TCPInfo) bool {
	if m.over {
		return true
	}
	if !ti.Read(m.sys) {
		m.over = true
		return true
	}
	acked := int64(ti.Info.Bytes_acked)
	switch {
	case acked >= m.target:
		m.found(acked, now, ti.Info.Delivery_rate)
	case !now.Before(m.until):
		m.over = true
	default:
		m.prev = now
		m.next = m.pastAgreed(now.Add(m.every))
		if now.After(m.est().Add(10 * time.Millisecond)) {
			m.next = now.Add(lookLater)
		}
	}
	return m.over
}

// found ends the watch on an acknowledgement of acked bytes found at
// now, keeping what it says (reading).
func (m *ackMark) found(acked int64, now time.Time, rate uint64) {
	m.ackedAt, m.over = m.reading(acked, now, rate), true
}

// reading is when an acknowledgement of acked bytes, found at now, says
// the token's bytes reached the client (zero: it says nothing usable),
// from the middle of this look and the last. One that covers later bytes
// too counts as it came only before they could have been acknowledged
// themselves (laterAckedBy), and as the next write's arrival when it ends
// exactly there (withNext); one of the token's bytes alone may be the
// client's timer (delayed); and the looks must have been near enough for
// what they measured (fine: an acknowledgement already there at the first
// look, long after the write, came at a time they cannot tell).
func (m *ackMark) reading(acked int64, now time.Time, rate uint64) time.Time {
	gap := now.Sub(m.prev)
	mid := m.prev.Add(gap / 2)
	var at time.Time
	switch by := m.laterAckedBy(); {
	case acked == m.target && m.delayed(mid):
		return time.Time{}
	case acked == m.target || !by.IsZero() && now.Before(by):
		at = mid
	case acked == m.laterEnd.Load():
		at = m.withNext(mid, rate)
	default: // it covers more than the next write
		return time.Time{}
	}
	if !m.fine(gap, at) {
		return time.Time{}
	}
	return at
}

// est is the round trip's estimate of when the client acknowledges the
// token's bytes: a round trip after their write.
func (m *ackMark) est() time.Time { return m.flush.Add(m.rtt) }

// spacing is how long after the token's bytes the next were written
// (false: none yet).
func (m *ackMark) spacing() (time.Duration, bool) {
	later := m.later.Load()
	return time.Duration(later - m.flush.UnixNano()), later != 0
}

// delackFloor is the shortest delay a client's delayed acknowledgement
// adds (Linux's minimum is 40 ms, Windows' 200 ms; a timer's tick
// earlier).
const delackFloor = 20 * time.Millisecond

// delayed reports that an acknowledgement of exactly the token's bytes,
// come at ack, may be the client's delayed acknowledgement and not the
// path's time. A client that keeps its connection alive sends its next
// request as soon as a response ends, and Linux then holds its
// acknowledgement of a lone small segment (a token) until a second comes
// or its timer runs out: with a token every 60 ms, half the kept-alive
// streams' tokens were acknowledged 40-43 ms late on a path with no queue,
// and client_ttft_ms carried that at the median. So on a connection's
// later responses (kept) one that came delackFloor or more past the round
// trip's estimate is not used, and the estimate stands, unless the next
// write followed the token within delackFloor: a client that holds its
// acknowledgements would have acknowledged both (withNext), so one that
// acknowledged the token alone does not, and behind a queue its
// acknowledgement measures it. A fresh connection's client acknowledges at
// once (Linux's quick acknowledgements): its acknowledgement is used; so
// is one of a write that went out split (ClientSide.SplitFirst), which
// the client acknowledges as it reads it.
func (m *ackMark) delayed(ack time.Time) bool {
	if !m.lagged || ack.Sub(m.est()) < delackFloor {
		return false
	}
	spacing, ok := m.spacing()
	return !ok || spacing >= delackFloor
}

// fine reports whether looks gap apart time an acknowledgement taken at at
// (their middle) well enough: within 2 lookLater, or within a quarter of
// how late it came past the round trip's estimate, so that the middle errs
// by an eighth of what it measures at most. A queue on the path comes with
// a busy machine, whose scheduler holds the looks' goroutine for a few
// milliseconds now and then: behind a 32 KiB/s bottleneck, with two test
// suites running beside it, the watch set aside marks looked at 2.0 to 10
// ms apart, 60 to 200 ms past the estimate, and the estimate missed the
// queue by as much. A look that finds the bytes long acknowledged at once
// (a handshake that met a queue made the round trip look longer) is not
// fine: the middle comes before the estimate.
func (m *ackMark) fine(gap time.Duration, at time.Time) bool {
	return gap <= 2*lookLater || gap <= at.Sub(m.est())/4
}

// withNext reads an acknowledgement of exactly the token's bytes and the
// next write's, come at ack after that write could have been acknowledged
// on its own. A client in Linux's interactive mode (one that sends its
// next request as soon as a response ends: a kept-alive HTTP client)
// acknowledges a small pushed segment once it has read a second, so its
// acknowledgement is the next write's arrival, and the token's came that
// write's spacing before: as far apart as they were written, or as long
// as the next write's bytes take at the connection's delivery rate (rate,
// bytes a second: tcpi_delivery_rate), whichever is longer; behind a queue
// the rate is the connection's share of the bottleneck. Taken as the
// acknowledgement of the token's bytes alone had been, it missed a 32
// KiB/s bottleneck by 55 ms at the median on kept-alive connections; set
// aside, it left the round trip's estimate, as far off. With the writes'
// spacing alone the median was 1.5 ms off and the 99th percentile 33-36
// ms, with the rate 1-1.5 ms and 20-25 ms (other streams' bytes pass the
// bottleneck between the two). So a kept-alive response's first write,
// when it carries the first token, goes out split (ClientSide.SplitFirst)
// and is acknowledged as it comes (0.4-0.5 ms off at the median, 1.0-1.3
// at the 99th percentile behind the same bottleneck): withNext reads the
// writes that were not (a segment of ours, or bytes unsent, still on the
// way when the token came). A time before the round trip's estimate is
// the estimate: no queue held the token.
func (m *ackMark) withNext(ack time.Time, rate uint64) time.Time {
	spacing, _ := m.spacing()
	if rate > 0 {
		spacing = max(spacing, time.Duration(float64(m.laterEnd.Load()-m.target)/float64(rate)*float64(time.Second)))
	}
	t := ack.Add(-spacing)
	if est := m.est(); t.Before(est) {
		return est
	}
	return t
}

// laterAckedBy is when the bytes written after the token's could first
// have been acknowledged: nine tenths of a round trip after them (the
// handshake's may be a little above the path's minimum); zero while none
// were written.
func (m *ackMark) laterAckedBy() time.Time {
	later := m.later.Load()
	if later == 0 {
		return time.Time{}
	}
	return time.Unix(0, later).Add(m.rtt * 9 / 10)
}

// ended tells the mark that its response ended at now, the connection's
// count at end, when the client had acknowledged acked bytes (rate: its
// delivery rate then). An acknowledgement first seen then is read as a
// look's. On a kept-alive connection whose client holds its
// acknowledgements (Linux's interactive mode), the acknowledgement of a
// response's last bytes comes with the client's next request, whenever
// it sends one, or with its timer: so when the acknowledgement that could
// still be read (of the token's bytes, or of the next write's: withNext)
// would be one of the response's end, one not seen by then says nothing
// of the path, and the watch ends there. With one-token streams relayed in
// one write at 300/s over kept-alive loopback connections, a quarter of
// them read the client's next request as the token's arrival:
// client_ttft_ms was 2.5 ms or more late for one stream in five, up to
// 17 ms at the 99th percentile, where the truth is 20 µs. A client that
// acknowledges at once (its connection idle for a while before the
// request) gives its acknowledgement up with it: behind a queue, such a
// stream's client_ttft_ms is the round trip's estimate.
func (m *ackMark) ended(acked, end int64, now time.Time, rate uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	last := m.target
	if m.later.Load() != 0 {
		last = m.laterEnd.Load()
	}
	switch {
	case m.over:
	case acked >= m.target:
		m.found(acked, now, rate)
	case m.lagged && last >= end:
		m.over = true
	}
}

// take ends the watch and returns when the token's bytes reached the
// client's kernel by its acknowledgement, or zero when no usable one came
// (or there is no mark).
func (m *ackMark) take() time.Time {
	if m == nil {
		return time.Time{}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.over = true
	return m.ackedAt
}

// nextLook and lookNow make a mark a Looker of the proxy's marks watch
// (LookWatch).
func (m *ackMark) NextLook() time.Time { return m.next }

func (m *ackMark) LookNow(now time.Time, ti *sock.TCPInfo) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.look(now, ti)
}
