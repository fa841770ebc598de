package measure

import (
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
	"github.com/tokentap/tokentap/proxy/internal/sock"
	"golang.org/x/sys/unix"
)

// The client's side of a request, network included. tokentap's own marks
// start when the request's first byte reached its kernel and end when a
// write was accepted by its kernel; the client lived each of them later
// by the path's delays: its request left one way-delay before it arrived,
// and each byte tokentap wrote reached it one way-delay after it left. The
// two one-way delays sum to the round trip, whatever their split, so
//
//	client TTFT = TTFT + RTT,   client TTFA = TTFA + RTT,
//	client E2E  = E2E + RTT + the time the kernel still held the last
//	              bytes unsent after tokentap wrote them (a congestion or
//	              receive window that was full: a fresh connection's first
//	              window, a slow client).
//
// The RTT is the handshake's: TCP_INFO's tcpi_min_rtt read when the
// connection is accepted, which is the SYN-ACK → ACK sample (a client
// answers a SYN-ACK at once, so no delayed ACK is in it). Later it is the
// larger of that and tcpi_min_rtt, the kernel's windowed minimum (net.ipv4.
// tcp_min_rtt_wlen, 300 s): a path that got slower shows within five
// minutes on a long-lived keep-alive connection. The smoothed RTT
// (tcpi_rtt, kept as client_srtt_ms) is inflated by the client's delayed
// ACKs, up to 40 ms a sample; a later minimum below the handshake's is
// mostly a sample taken from TCP timestamps, whose clock ticks in
// milliseconds (measured over the netsim link: 0.7–1 ms low at 100 ms one
// way). What the RTT cannot see: a queue on the way to the client, a
// segment lost and sent again (counted in client_retrans), time in the
// client's own stack. For the first token and the first answer token the
// client's acknowledgement of their bytes shows the first two (tokenack.go).

// delivery is what TCP_INFO said of the client connection at the end of a
// response, and the acknowledgement of its last bytes.
type delivery struct {
	ok             bool
	minRTT, srtt   time.Duration
	notsent        int64         // bytes written and not yet sent, at the last reading
	departed       time.Time     // when the last byte left (notsent seen at 0)
	wire           int64         // this response's bytes written
	stall          time.Duration // how long its writes waited for the client
	retrans        int
	watched        bool // acked was read until all was acknowledged or the wait ran out
	unknown        bool // the connection closed before its count could be read
	waitUntil      time.Time
	waitCap        time.Time     // the longest the wait may be drawn out to (maxAckWait)
	next           time.Time     // the next look at the acknowledgement (ClientSide.Schedule)
	pause          time.Duration // the pause before the look after it
	recovering     bool          // the kernel was sending lost segments again at the last reading
	rto            time.Duration // its retransmission timeout then
	retransFrom    uint32        // the connection's retransmissions when the response ended
	ackedAt, total int64         // the kernel's count, and what it must reach
}

// maxAckWait bounds the wait for the client's ACK of a response's last
// bytes, losses included: a record waits no longer for its figures.
const maxAckWait = 2 * time.Second

// note takes a TCP_INFO reading at now: the count acknowledged, and
// whether bytes still wait unsent. The server writes the end of a chunked
// body it frames (its last chunk, after WriteTo) after the exchange ended, so unsent bytes seen
// later push the departure back; the first reading with none sets it.
func (d *delivery) note(in *unix.TCPInfo, ackBase int64, now time.Time) {
	d.ackedAt = int64(in.Bytes_acked) - ackBase
	// Segments lost or sent again and not yet acknowledged, or a
	// retransmission timeout that fired: the connection is recovering.
	// So is one that sent anything again since the response ended: its
	// client may still be waiting for those bytes.
	d.recovering = in.Lost > 0 || in.Retrans > 0 || in.Retransmits > 0 || in.Total_retrans > d.retransFrom
	d.rto = time.Duration(in.Rto) * time.Microsecond
	if d.notsent = int64(in.Notsent_bytes); d.notsent > 0 {
		d.departed = time.Time{}
	} else if d.departed.IsZero() {
		d.departed = now
	}
}

// pathRTT is the connection's round trip without delays at either end:
// the kernel's windowed minimum of its samples (minRTT), or the
// handshake's sample (syn) where the two are within a millisecond. Samples
// of data that was sent again come from TCP timestamps, whose clock ticks
// in milliseconds, and can pull the minimum up to a millisecond below the
// path's RTT; a minimum further below shows a handshake that met a queue
// (or a busy peer), which the samples since have seen through. A minimum
// above the handshake's is a path that got slower.
func pathRTT(minRTT, syn time.Duration) time.Duration {
	if syn > 0 && (minRTT <= 0 || minRTT < syn && syn-minRTT <= time.Millisecond) {
		return syn
	}
	return minRTT
}

// Wire is what a client connection keeps of its delivery for the
// measurement: its socket for TCP_INFO, the bytes written to it and how
// long its writes waited for the client, and what TCP_INFO said when it was
// accepted and when it closed. The connection (proxy/clientconn) keeps it
// up to date; ClientSide reads it.
type Wire struct {
	Sys  syscall.RawConn // for TCP_INFO (nil: not available)
	Sent int64           // bytes written to the connection
	// Stall is how long writes waited for the client to take bytes (its
	// socket buffer was full: a client that reads slowly).
	Stall   time.Duration
	AckBase int64         // tcpi_bytes_acked when accepted (the SYN may count), -1 unknown
	Retrans uint32        // tcpi_total_retrans at the last reading
	SynRTT  time.Duration // the handshake's RTT sample (tcpi_min_rtt when accepted)
	// FloorNoted is the path RTT this connection last gave the proxy's
	// pathFloors: a kept-alive connection notes it again only when it
	// changed, not under the floors' lock on every response.
	FloorNoted time.Duration
	// ClosedAcked is tcpi_bytes_acked read just before the close (0: not
	// read), for a record still waiting for the client's acknowledgement.
	ClosedAcked atomic.Int64
	IP          netip.Addr
	// Split asks that the next write go out as two segments, so that a
	// client that delays its acknowledgements acknowledges it as it comes
	// (ClientSide.SplitFirst); SplitAt is Sent at the end of the last
	// write that did (0: none).
	Split   bool
	SplitAt int64
}

// Accepted reads TCP_INFO as the connection opens (ti is the reader's
// buffer): the acknowledged count to count from, the retransmissions and
// the handshake's round trip.
func (w *Wire) Accepted(ti *sock.TCPInfo) {
	w.AckBase = -1
	if ti.Read(w.Sys) {
		w.AckBase, w.Retrans = int64(ti.Info.Bytes_acked), ti.Info.Total_retrans
		w.SynRTT = time.Duration(ti.Info.Min_rtt) * time.Microsecond
	}
}

// Closing reads the acknowledged count once more just before the
// connection closes, for a record still waiting for it.
func (w *Wire) Closing() {
	var ti sock.TCPInfo
	if ti.Read(w.Sys) {
		w.ClosedAcked.Store(int64(ti.Info.Bytes_acked))
	}
}

// Acks is the proxy's watch of the clients' acknowledgements: the floors
// of their paths' round trips (per address) and the marks waiting for
// the acknowledgement of the first tokens' bytes, looked at from one
// goroutine.
type Acks struct {
	floors pathFloors
	marks  LookWatch
}

// ClientSide is the response's delivery to the client connection: where
// it began on the connection, the marks waiting for the acknowledgement of
// the first tokens' bytes, and what TCP_INFO said at its end and while
// the record waits for the client's acknowledgement. Owner: the
// exchange's serving goroutine until the response ends; then the
// proxy's watch of waiting records while the record waits, and the
// record.
type ClientSide struct {
	cc        *Wire // nil: not a connection tokentap accepted
	sentFrom  int64 // the connection's count when the response began
	stallFrom time.Duration
	// The acknowledgement of the bytes that carried the first token and
	// the first answer token (the same mark when one write carried both).
	tokMark, ansMark *ackMark
	deliv            delivery
	// paired: the write that carries the first token follows one of the
	// response's segments the client holds unacknowledged (SplitFirst).
	paired bool
	// stream: one stream of a connection many share (HTTP/2), whose own
	// counts these are, not the connection's (nil: the connection's
	// response).
	stream *StreamCounts
}

// StreamCounts are what one stream of a connection many streams share
// (HTTP/2) counts of its delivery, kept by the stream's writer: how long
// its writes waited for the client (its flow-control window, or the
// socket), and the connection's count of bytes written at the end of the
// socket write that carried its last delivered bytes (0: none), the
// offset whose acknowledgement says the client's kernel had them.
type StreamCounts struct {
	Stall time.Duration
	Sent  int64
}

// Start notes where the response begins on the client connection whose
// Wire is w (nil: not a connection tokentap accepted).
func (cs *ClientSide) Start(w *Wire) {
	if w != nil {
		cs.cc, cs.sentFrom, cs.stallFrom = w, w.Sent, w.Stall
	}
}

// StartStream notes a response on one stream of a connection that many
// streams share (HTTP/2), whose Wire is w: the connection's path (its
// round trip) is the stream's, its counts are not. The stream's
// client-side times are its own plus the path's round trip, or the
// acknowledgement of the connection's bytes up to where its first
// tokens ended (c.Sent); it has no bytes on the wire of its own. c is
// the stream's counts; from the connection's count when it began.
func (cs *ClientSide) StartStream(w *Wire, c *StreamCounts, from int64) {
	cs.cc, cs.stream, cs.stallFrom, cs.sentFrom = w, c, c.Stall, from
}

// Sent is the client connection's count of bytes written (0: unknown).
func (cs *ClientSide) Sent() int64 {
	if cs.stream != nil {
		return cs.stream.Sent
	}
	if cs.cc == nil {
		return 0
	}
	return cs.cc.Sent
}

// Mark watches for the client's acknowledgement of the bytes that
// carried the stream's first token (tok) and first answer token (ans),
// delivered at t with the connection's count at sent; one mark serves
// both when one delivery carried them.
func (cs *ClientSide) Mark(a *Acks, tok, ans bool, t time.Time, sent int64, now func() time.Time) {
	cc := cs.cc
	if !tok && !ans || cc == nil || cc.Sys == nil || cc.AckBase < 0 || cs.stream != nil && sent <= 0 {
		return
	}
	// The handshake's round trip, or the address's lowest lately where
	// that is lower: a handshake that met a queue would time the first
	// looks too late.
	m := newAckMark(cc.Sys, cc.AckBase+sent, t, a.floors.floor(cc.IP, cc.SynRTT, t))
	m.lagged = cs.sentFrom > 0 && (cs.stream != nil || cc.SplitAt != sent) && !(tok && cs.paired)
	if tok {
		cs.paired = false // SplitFirst's word was of this write
	}
	a.marks.Add(m, now)
	if tok {
		cs.tokMark = m
	}
	if ans {
		cs.ansMark = m
	}
}

// SplitFirst is told, before bytes of the response are written, that
// they will carry its first token (ti: a TCP_INFO buffer to read with).
// On a kept-alive connection, whose client may hold its acknowledgement of
// a lone segment, the write goes out as two segments when the client had
// acknowledged every byte before it, the kernel holds none unsent and
// the client's window is open (downstream.Conn.writeSplit), so that the
// acknowledgement of the token's bytes comes as they reach the client,
// whether or not more bytes follow soon. A client that holds one of this
// response's segments unacknowledged (a header, or a role-only event,
// written alone) acknowledges the token's write as its second, as it
// reads it (paired); a fresh connection's client acknowledges at once
// (Linux's quick acknowledgements); an HTTP/2 client acknowledges its
// streams' bytes with its WINDOW_UPDATE frames.
//
// The caller asks MaySplit first, and reads TCP_INFO only for a response
// that may.
func (cs *ClientSide) SplitFirst(ti *sock.TCPInfo) {
	cc := cs.cc
	cs.paired = false
	if !ti.Read(cc.Sys) {
		return
	}
	in := &ti.Info
	cc.Split = in.Unacked == 0 && in.Notsent_bytes == 0 && in.Snd_wnd > 0
	// Paired: every byte before the response acknowledged, and its own
	// unacknowledged ones sent within delackFloor (tcpi_last_data_sent, in
	// ms), so that the client's timer (40 ms at least) cannot have
	// acknowledged them alone before the token's bytes come.
	cs.paired = !cc.Split && in.Unacked > 0 && in.Notsent_bytes == 0 &&
		time.Duration(in.Last_data_sent)*time.Millisecond < delackFloor &&
		int64(in.Bytes_acked)-cc.AckBase >= cs.sentFrom
}

// Paired reports that the write SplitFirst was last asked about follows
// one of the response's own segments the client holds unacknowledged:
// the client acknowledges the two as it reads the second.
func (cs *ClientSide) Paired() bool { return cs.paired }

// MaySplit reports a response on a kept-alive connection tokentap
// accepted, its own (not an HTTP/2 stream's), whose split is not asked
// for yet.
func (cs *ClientSide) MaySplit() bool {
	cc := cs.cc
	return cc != nil && !cc.Split && cs.stream == nil && cs.sentFrom > 0 && cc.AckBase >= 0
}

// byAck is a client-side time estimated by the round trip (est), or by
// the acknowledgement of its bytes (acked, zero: none usable) since the
// request's arrival when the two differ by more than AckAgree: within it
// the round trip's is the more precise (an acknowledgement is looked for
// every half millisecond, and the way back of one packet is not the way in
// of another).
func byAck(est time.Duration, acked, arrival time.Time) time.Duration {
	if est < 0 || acked.IsZero() {
		return est
	}
	if a := acked.Sub(arrival); a > est+AckAgree || a < est-AckAgree {
		return a
	}
	return est
}

// AckAgree is how far apart the two estimates of a client-side time may
// be before the acknowledgement's is taken.
const AckAgree = time.Millisecond

// marks are the response's first-token and first-answer-token marks (nil:
// none; one mark may be both).
func (cs *ClientSide) marks() [2]*ackMark { return [2]*ackMark{cs.tokMark, cs.ansMark} }

// LaterBytes tells the marks waiting for their acknowledgement that bytes
// after theirs were written at t, up to the connection's count sent.
func (cs *ClientSide) LaterBytes(t time.Time, sent int64) {
	for _, m := range cs.marks() {
		if m != nil && m.flush.Before(t) && m.later.Load() == 0 {
			m.laterEnd.Store(cs.cc.AckBase + sent)
			m.later.Store(t.UnixNano())
		}
	}
}

// Stalled is how long this response's writes waited for the client so far.
func (cs *ClientSide) Stalled() time.Duration {
	if cs.stream != nil {
		return cs.stream.Stall - cs.stallFrom
	}
	if cs.cc == nil {
		return 0
	}
	return cs.cc.Stall - cs.stallFrom
}

// Ended reads TCP_INFO at the end of the response into ti, on the
// handler's goroutine. It reports whether the record should wait for the
// client's acknowledgement of the last bytes (watch: the connection is
// healthy, so the wait can tell). With on false (Options.NoClientSide) it
// reads nothing: only the client's stalls are kept.
func (cs *ClientSide) Ended(watch bool, now time.Time, a *Acks, on bool, ti *sock.TCPInfo) (wait bool) {
	cc := cs.cc
	d := &cs.deliv
	*d = delivery{stall: cs.Stalled()}
	if cc != nil && cs.stream == nil {
		cc.Split = false // a response that wrote nothing leaves none for the next
	}
	if !on || cc == nil || cc.AckBase < 0 || !ti.Read(cc.Sys) {
		return false
	}
	in := &ti.Info
	d.ok = true
	d.minRTT = pathRTT(time.Duration(in.Min_rtt)*time.Microsecond, cc.SynRTT)
	d.srtt = time.Duration(in.Rtt) * time.Microsecond
	d.retransFrom = in.Total_retrans
	done := false
	if st := cs.stream; st != nil {
		// The connection's counts are every stream's, and its writer's:
		// the path is read, whether bytes wait unsent, and the
		// acknowledgement up to where this stream's last bytes ended. The
		// record waits until the kernel sent all and the client
		// acknowledged them (the departure an upper bound of the stream's
		// last bytes' when other streams' follow), so that its first
		// tokens' marks have their acknowledgement.
		a.floors.floor(cc.IP, d.minRTT, now)
		d.total = st.Sent
		d.note(in, cc.AckBase, now)
		done = d.notsent == 0 && d.ackedAt >= d.total
	} else {
		if d.minRTT != cc.FloorNoted {
			a.floors.floor(cc.IP, d.minRTT, now)
			cc.FloorNoted = d.minRTT
		}
		d.retrans = int(in.Total_retrans - cc.Retrans)
		cc.Retrans = in.Total_retrans
		d.wire = cc.Sent - cs.sentFrom
		d.total = cc.Sent
		d.note(in, cc.AckBase, now)
		done = d.ackedAt >= d.total || d.wire == 0
	}
	for _, m := range cs.marks() {
		if m != nil {
			m.ended(int64(in.Bytes_acked), cc.AckBase+d.total, now, in.Delivery_rate)
		}
	}
	if done || !watch {
		d.watched = d.ackedAt >= d.total
		return false
	}
	// The last bytes are on their way, or wait for a window to open: the
	// client's ACK comes a round trip after they leave, or its delayed ACK
	// up to 40 ms (200 ms on some stacks) later. Watch for about that long.
	d.waitUntil = now.Add(min(3*max(d.srtt, d.minRTT)+250*time.Millisecond, maxAckWait))
	d.waitCap = now.Add(maxAckWait)
	return true
}

// Await polls TCP_INFO until the client acknowledged the response or
// the wait ran out (Schedule, Look), sleeping between looks. It is
// for a record that waits on its own goroutine anyway (a compressed body's
// side decoder); the others wait on the proxy's ackWatch.
func (cs *ClientSide) Await(now func() time.Time) {
	var ti sock.TCPInfo
	for !cs.Schedule(now()) {
		time.Sleep(cs.deliv.next.Sub(now()))
		if cs.Look(now(), &ti) {
			return
		}
	}
}

// Schedule decides when to look at the client's acknowledgement next
// (d.next): every half millisecond while bytes wait unsent (their departure
// ends the client's E2E), then each time twice as long after the last
// (from half a millisecond). It reports true when the wait is over
// instead: its time ran out, drawn out while the kernel resends lost
// segments.
func (cs *ClientSide) Schedule(now time.Time) (over bool) {
	d := &cs.deliv
	left := d.waitUntil.Sub(now)
	if left <= 0 && d.recovering && d.waitUntil.Before(d.waitCap) {
		// The kernel is still sending lost segments again: their ACK
		// comes a retransmission timeout and a round trip later.
		d.waitUntil = now.Add(min(d.rto+max(d.srtt, d.minRTT), d.waitCap.Sub(now)))
		left = d.waitUntil.Sub(now)
	}
	if left <= 0 {
		d.watched = true
		return true
	}
	if d.pause == 0 {
		d.pause = 500 * time.Microsecond
	}
	if d.notsent > 0 {
		d.next = now.Add(min(500*time.Microsecond, left))
	} else {
		d.next = now.Add(min(d.pause, left))
		d.pause *= 2
	}
	return false
}

// NextLook is when the acknowledgement is to be looked at next
// (Schedule).
func (cs *ClientSide) NextLook() time.Time { return cs.deliv.next }

// Look reads TCP_INFO once, into ti; true when the client acknowledged
// all or the connection closed meanwhile (it left its last count in
// closedAcked).
func (cs *ClientSide) Look(now time.Time, ti *sock.TCPInfo) (over bool) {
	d := &cs.deliv
	if !ti.Read(cs.cc.Sys) {
		if acked := cs.cc.ClosedAcked.Load(); acked > 0 {
			d.ackedAt, d.watched = acked-cs.cc.AckBase, true
			if d.departed.IsZero() && d.ackedAt >= d.total {
				d.departed = now // a bound: it left before the close
			}
		} else {
			d.unknown = true
		}
		return true
	}
	d.note(&ti.Info, cs.cc.AckBase, now)
	if cs.stream != nil {
		d.watched = d.notsent == 0 && d.ackedAt >= d.total
		return d.watched
	}
	if d.ackedAt >= d.total {
		d.watched = true
		return true
	}
	return false
}

// Fill derives the client's side of rec from its timings and the
// delivery of a request that arrived at arrival.
func (cs *ClientSide) Fill(rec *metrics.Record, arrival time.Time) {
	d := &cs.deliv
	rec.ClientStall = d.stall
	tokAck, ansAck := cs.tokMark.take(), cs.ansMark.take()
	if !d.ok {
		return
	}
	rec.ClientRTT, rec.ClientSRTT, rec.ClientRetrans = d.minRTT, d.srtt, d.retrans
	if d.wire > 0 && !d.unknown {
		// Only for bodies relayed as they came: a body fasthttp writes
		// after the exchange ends (a fixed-length or tokentap's own
		// answer) is not on the wire yet at the end.
		rec.BytesWire = d.wire
		rec.BytesAcked = min(max(d.wire-(d.total-d.ackedAt), 0), d.wire)
		rec.Unacked = d.watched && rec.BytesAcked < d.wire
	}
	plus := func(t time.Duration) time.Duration {
		if t < 0 {
			return metrics.Absent
		}
		return t + d.minRTT
	}
	rec.ClientTTFT, rec.ClientTTFA = plus(rec.TTFT), plus(rec.TTFA)
	// The client's acknowledgement of the token's bytes, where one was
	// usable and says otherwise: what the path added beyond its minimum (a
	// queue, a segment sent again) shows in it, and a round trip measured
	// through a queue (a handshake that met one) does not.
	rec.ClientTTFT = byAck(rec.ClientTTFT, tokAck, arrival)
	rec.ClientTTFA = byAck(rec.ClientTTFA, ansAck, arrival)
	if rec.E2E >= 0 && !rec.Unacked {
		// The last write was accepted E2E after arrival; its bytes left
		// then, or when the kernel was seen to have sent them. A response
		// the client did not acknowledge whole has no client E2E: when it
		// got the end, if ever, is unknown.
		var held time.Duration
		if !d.departed.IsZero() {
			held = max(d.departed.Sub(arrival)-rec.E2E, 0)
		}
		rec.ClientE2E = plus(rec.E2E) + held
	}
}
