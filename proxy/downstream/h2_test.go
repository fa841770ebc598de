package downstream

import (
	"io"
	"strings"
	"testing"
	"time"
)

// pieces reads its strings one per Read, then io.EOF.
type pieces []string

func (p *pieces) Read(b []byte) (int, error) {
	if len(*p) == 0 {
		return 0, io.EOF
	}
	n := copy(b, (*p)[0])
	if (*p)[0] = (*p)[0][n:]; (*p)[0] == "" {
		*p = (*p)[1:]
	}
	return n, nil
}

// readAll reads c's plain text from src as the server would, in reads of
// size.
func readAll(c *Conn, src io.Reader, size int) string {
	var out strings.Builder
	b := make([]byte, size)
	for {
		n, err := c.readPlain(b, src)
		out.Write(b[:n])
		if err != nil {
			return out.String()
		}
	}
}

// The first read tells HTTP/2 by its preface, however the preface was
// split; anything else, "P" first included, is read as it came, its
// header scanned as before.
func TestFirstReadTellsHTTP2(t *testing.T) {
	frames := "\x00\x00\x00\x04\x00\x00\x00\x00\x00"
	for _, c := range []struct {
		name   string
		reads  []string
		h2     bool
		bareLF bool
	}{
		{"preface whole", []string{h2Preface + frames}, true, false},
		{"preface split", []string{"P", "RI * HTTP/2", ".0\r\n\r\nSM\r\n", "\r\n" + frames}, true, false},
		{"POST", []string{"P", "OST / HTTP/1.1\r\nHost: a\r\n\r\n"}, false, false},
		{"PRI of HTTP/1.1", []string{"PRI * HTTP/1.1\r\nHost: a\r\n\r\n"}, false, false},
		{"preface cut short", []string{"PRI * HTTP/2.0\r\n"}, false, false},
		{"bare LFs after P", []string{"P", "UT / HTTP/1.1\nHost: a\n\n"}, false, true},
	} {
		for _, size := range []int{4096, 7} {
			conn := &Conn{inHead: true}
			src := pieces(append([]string(nil), c.reads...))
			got := readAll(conn, &src, size)
			sent := strings.Join(c.reads, "")
			want := sent
			if c.h2 {
				want = h2Marker + sent
			}
			if c.bareLF {
				if !conn.bareLF {
					t.Errorf("%s, reads of %d: a header of bare LFs not seen", c.name, size)
				}
				continue
			}
			if conn.H2() != c.h2 || got != want {
				t.Errorf("%s, reads of %d: h2 %v, read %q; want %v, %q", c.name, size, conn.H2(), got, c.h2, want)
			}
			if c.h2 && conn.inHead {
				t.Errorf("%s: an HTTP/2 connection's frames would be scanned as a header", c.name)
			}
		}
	}
}

// FuzzFirstRead: whatever a connection's first bytes and however they
// are split, the reads return them as they came, or, when they begin
// with HTTP/2's preface, the marker and then them; nothing is lost,
// nothing made up.
func FuzzFirstRead(f *testing.F) {
	f.Add([]byte(h2Preface+"\x00\x00\x00\x04\x00\x00\x00\x00\x00"), uint8(1), uint8(7))
	f.Add([]byte("POST / HTTP/1.1\r\nHost: a\r\n\r\n"), uint8(1), uint8(3))
	f.Add([]byte("PRI * HTTP/2.0\r\n"), uint8(5), uint8(2))
	f.Fuzz(func(t *testing.T, b []byte, cut, size uint8) {
		var reads []string
		for rest, k := b, int(cut)%8+1; len(rest) > 0; k = k%5 + 1 {
			k = min(k, len(rest))
			reads = append(reads, string(rest[:k]))
			rest = rest[k:]
		}
		conn := &Conn{inHead: true}
		src := pieces(reads)
		got := readAll(conn, &src, int(size)%64+1)
		want := string(b)
		if len(b) >= len(h2Preface) && string(b[:len(h2Preface)]) == h2Preface {
			want = h2Marker + want
			if !conn.H2() {
				t.Fatalf("%q: not told HTTP/2", b)
			}
		} else if conn.H2() {
			t.Fatalf("%q: told HTTP/2", b)
		}
		if conn.bareLF {
			return // the header scan stops the reads (ErrBareLF)
		}
		if got != want {
			t.Fatalf("%q in reads %q: read %q", b, reads, got)
		}
	})
}

// A stream's bytes end in the first of the socket writes started after it
// asked that carries, with those before it, as many bytes as its DATA
// frame: a write of its HEADERS alone, flushed between the two frames, is
// passed over. A wait that came more than the ring's writes late gets
// the last end; a closed connection or the timer, none.
func TestH2WritesWaitForTheDataFrame(t *testing.T) {
	var w h2Writes
	sent := int64(0)
	write := func(n int64) {
		w.started()
		sent += n
		w.ended(sent)
	}
	write(500) // before the stream asked
	after := w.begunSoFar()
	got := make(chan int64)
	go func() { got <- w.wait(after, 200+h2FrameHeader, nil) }()
	write(60)  // the HEADERS frame alone
	write(209) // the DATA frame
	if end := <-got; end != 769 {
		t.Errorf("the stream's bytes end at %d, want 769 (the DATA frame's write)", end)
	}
	// Frames of others before its own in one write: that write.
	after = w.begunSoFar()
	write(60 + 300)
	if end := w.wait(after, 200+h2FrameHeader, nil); end != 1129 {
		t.Errorf("got %d, want 1129", end)
	}
	// Its DATA frame cut across two writes (the buffer filled): the end
	// is in the write that reaches its size.
	after = w.begunSoFar()
	write(100)
	write(150)
	if end := w.wait(after, 200+h2FrameHeader, nil); end != 1379 {
		t.Errorf("got %d, want 1379", end)
	}
	after = w.begunSoFar()
	for range len(w.ends) + 1 {
		write(10)
	}
	if end := w.wait(after, 1000, nil); end != sent {
		t.Errorf("a wait more than the ring late got %d, want the last end %d", end, sent)
	}
	after = w.begunSoFar()
	timer := make(chan time.Time, 1)
	timer <- time.Now()
	if end := w.wait(after, 10, timer); end != 0 {
		t.Errorf("a wait whose timer fired got %d", end)
	}
	w.close()
	if end := w.wait(after, 10, nil); end != 0 {
		t.Errorf("a wait on a closed connection got %d", end)
	}
}
