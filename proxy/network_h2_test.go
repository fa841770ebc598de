package proxy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2Client is a client of the delay-link tests that speaks HTTP/2 with
// prior knowledge on one connection, one stream after another, frame by
// frame: it knows where in the connection's bytes each of its requests
// began and where the first token and the last byte of each response
// came, as the HTTP/1.1 clients do (netsim.Link.WireTime finds when they
// crossed the client's device).
type h2Client struct {
	c    net.Conn
	fr   *http2.Framer
	r    tallyReader
	w    countedWriter
	hb   bytes.Buffer
	enc  *hpack.Encoder
	next uint32
}

// countedWriter counts the bytes written through it (tallyReader's
// other side).
type countedWriter struct {
	w io.Writer
	n int64
}

func (c *countedWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}

// dialH2 opens an HTTP/2 connection to addr: the preface and the
// client's settings.
func dialH2(addr string) (*h2Client, error) { return dialH2With(addr) }

// dialH2With is dialH2 with settings.
func dialH2With(addr string, settings ...http2.Setting) (*h2Client, error) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	h := &h2Client{c: c, r: tallyReader{r: c}, w: countedWriter{w: c}, next: 1}
	h.fr = http2.NewFramer(&h.w, &h.r)
	h.enc = hpack.NewEncoder(&h.hb)
	if _, err := io.WriteString(&h.w, http2.ClientPreface); err != nil {
		return nil, err
	}
	return h, h.fr.WriteSettings(settings...)
}

// send sends a streamed chat as a new stream, with body as its request
// id, and returns the stream's id.
func (h *h2Client) send(id string) uint32 {
	sid, body := h.next, `{"model":"m","stream":true,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	h.next += 2
	h.hb.Reset()
	for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", "tokentap"}, {":path", "/v1/chat/completions"},
		{"content-type", "application/json"}, {"x-request-id", id}, {"content-length", strconv.Itoa(len(body))}} {
		_ = h.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: sid, BlockFragment: h.hb.Bytes(), EndHeaders: true}) == nil {
		_ = h.fr.WriteData(sid, true, []byte(body))
	}
	return sid // a failed write shows on the next read
}

// stream sends one streamed chat as a new stream and measures as
// streamOver does, with the offsets in the connection's bytes.
func (h *h2Client) stream(id string) (clientTimes, error) {
	ct := clientTimes{port: uint16(h.c.LocalAddr().(*net.TCPAddr).Port), reqOff: h.w.n}
	start := time.Now()
	ct.start = start
	sid := h.send(id)
	_ = h.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	var got []byte
	for {
		off := h.r.n
		f, err := h.fr.ReadFrame()
		at := time.Since(start)
		if err != nil {
			return ct, fmt.Errorf("after %d bytes: %w", len(got), err)
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				err = h.fr.WriteSettingsAck()
			}
		case *http2.PingFrame:
			if !f.IsAck() {
				err = h.fr.WritePing(true, f.Data)
			}
		case *http2.RSTStreamFrame, *http2.GoAwayFrame:
			return ct, fmt.Errorf("the server ended the stream: %v", f)
		case *http2.DataFrame:
			if f.StreamID != sid {
				continue
			}
			data := f.Data()
			before := len(got)
			got = append(got, data...)
			if ct.ttft == 0 {
				if i := firstContent(got); i >= 0 {
					ct.ttft, ct.tokOff = at, off+9+int64(i-before) // the frame's header is 9 bytes
				}
			}
			if f.StreamEnded() {
				ct.e2e, ct.endOff = at, off+8+int64(len(data))
				return ct, nil
			}
			if len(data) > 0 { // the connection's window: the stream's ends with it
				err = h.fr.WriteWindowUpdate(0, uint32(len(data)))
			}
		}
		if err != nil {
			return ct, err
		}
	}
}

func (h *h2Client) Close() error { return h.c.Close() }

// runH2Clients is worker w of the HTTP/2 clients: per streams, one after
// another, on one connection; each measured as serveNetClients prints.
func runH2Clients(w, per int, addr string, mu *sync.Mutex, failed *bool) {
	h, err := dialH2(addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "netclients:", err)
		mu.Lock()
		*failed = true
		mu.Unlock()
		return
	}
	defer h.Close()
	for i := range per {
		id := fmt.Sprintf("h2-w%d-%d", w, i)
		ct, err := h.stream(id)
		mu.Lock()
		if err != nil {
			fmt.Fprintln(os.Stderr, "netclients:", id, err)
			*failed = true
			mu.Unlock()
			return
		}
		fmt.Printf("%s %d %d %d %d %d %d %d\n", id, ct.ttft, ct.e2e, ct.start.UnixNano(), ct.port, ct.reqOff, ct.tokOff, ct.endOff)
		mu.Unlock()
	}
}
