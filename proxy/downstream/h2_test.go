package downstream

import (
	"io"
	"strings"
	"testing"
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
