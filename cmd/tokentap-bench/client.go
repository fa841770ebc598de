package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/tidwall/gjson"
	"github.com/tokentap/tokentap/sse"
	"github.com/tokentap/tokentap/sse/dialect"
)

// client is a lean HTTP/1.1 client on raw keep-alive sockets. It stamps
// every chunk of a response as it is read, which general-purpose HTTP
// clients do not expose, and costs a few microseconds per request.
type client struct {
	addr    string
	host    string
	path    string
	headers string // extra request header lines, each ending in CRLF
	timeout time.Duration
	tls     *tls.Config // https: TLS on each connection (the kernel's stamps then equal the reads')

	mu   sync.Mutex
	idle []*conn

	// h2: an h2c:// URL's HTTP/2 transport (client_h2.go), with the extra
	// header fields; nil: HTTP/1.1 on the raw sockets.
	h2        *http.Transport
	h2Headers map[string]string
}

type conn struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
	p  *sse.Parser
}

func newClient(rawURL string, headers map[string]string, timeout time.Duration, tlsCfg *tls.Config) (*client, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https" && u.Scheme != "h2c") || u.Host == "" {
		return nil, fmt.Errorf("url %q: want http://host:port/path, https:// or h2c://", rawURL)
	}
	cl := &client{addr: u.Host, host: u.Host, path: u.RequestURI(), timeout: timeout}
	if u.Scheme == "h2c" {
		cl.h2, cl.h2Headers = h2cTransport(), headers
	}
	if u.Scheme == "https" {
		cl.tls = &tls.Config{ServerName: u.Hostname(), NextProtos: []string{"http/1.1"}}
		if tlsCfg != nil {
			cl.tls = tlsCfg.Clone()
			if cl.tls.ServerName == "" {
				cl.tls.ServerName = u.Hostname()
			}
		}
	}
	if u.Port() == "" {
		cl.addr = net.JoinHostPort(u.Hostname(), "80")
		if u.Scheme == "https" {
			cl.addr = net.JoinHostPort(u.Hostname(), "443")
		}
	}
	for k, v := range headers {
		cl.headers += k + ": " + v + "\r\n"
	}
	return cl, nil
}

// get returns a pooled connection (reused) or, with fresh or none
// pooled, a new one.
func (cl *client) get(fresh bool) (c *conn, reused bool, err error) {
	cl.mu.Lock()
	if n := len(cl.idle); n > 0 && !fresh {
		c := cl.idle[n-1]
		cl.idle = cl.idle[:n-1]
		cl.mu.Unlock()
		return c, true, nil
	}
	cl.mu.Unlock()
	c, err = cl.dial()
	return c, false, err
}

func (cl *client) dial() (*conn, error) {
	nc, err := net.DialTimeout("tcp", cl.addr, 5*time.Second)
	if err != nil {
		return nil, err
	}
	nc = stampConn(nc)
	if cl.tls != nil {
		tc := tls.Client(nc, cl.tls)
		_ = tc.SetDeadline(time.Now().Add(5 * time.Second))
		if err := tc.Handshake(); err != nil {
			nc.Close()
			return nil, err
		}
		_ = tc.SetDeadline(time.Time{})
		nc = tc
	}
	return &conn{c: nc, br: bufio.NewReaderSize(nc, 32<<10), bw: bufio.NewWriterSize(nc, 16<<10), p: sse.NewParser(1 << 20)}, nil
}

func (cl *client) put(c *conn) {
	cl.mu.Lock()
	cl.idle = append(cl.idle, c)
	cl.mu.Unlock()
}

// closeIdle closes the pooled connections.
func (cl *client) closeIdle() {
	cl.mu.Lock()
	for _, c := range cl.idle {
		c.c.Close()
	}
	cl.idle = nil
	cl.mu.Unlock()
	if cl.h2 != nil {
		cl.h2.CloseIdleConnections()
	}
}

// result is what the client saw of one request.
type result struct {
	ID       string        `json:"request_id"`
	Workload string        `json:"workload,omitempty"`
	Status   int           `json:"status"`
	Err      string        `json:"error,omitempty"`
	Timeout  bool          `json:"timeout,omitempty"`
	Start    time.Time     `json:"-"`
	TTFB     time.Duration `json:"-"`
	TTFT     time.Duration `json:"-"` // -1: no token
	E2E      time.Duration `json:"-"`
	// The same two on the kernel's clock: when the bytes reached this
	// machine rather than when the client read them (as E2E and TTFT when
	// the connection carries no receive stamps).
	TTFTKernel, E2EKernel time.Duration   `json:"-"`
	Tokens                []time.Duration `json:"-"` // arrival of each token event, from Start
	Delays                []time.Duration `json:"-"` // delivery delay of stamped tokens
	Output                int             `json:"output_tokens"`
	Input                 int             `json:"input_tokens"`
	Bytes                 int             `json:"bytes"`
}

// ITL returns the gaps between consecutive token events.
func (r *result) ITL() []time.Duration {
	var g []time.Duration
	for i := 1; i < len(r.Tokens); i++ {
		g = append(g, r.Tokens[i]-r.Tokens[i-1])
	}
	return g
}

// TPOT is (E2E − TTFT) / (output − 1), or -1.
func (r *result) TPOT() time.Duration {
	if r.TTFT < 0 || r.Output < 2 {
		return -1
	}
	return (r.E2E - r.TTFT) / time.Duration(r.Output-1)
}

var errStatus = errors.New("bad response")

// do sends one POST and reads the whole response, stamping token events.
func (cl *client) do(id string, body []byte, stamped bool) result {
	if cl.h2 != nil {
		return cl.doH2(id, body, stamped)
	}
	res, stale := cl.try(id, body, stamped, false)
	if stale {
		// The server closed a pooled connection while it sat idle (its
		// keep-alive timeout): the request never reached it, so it goes
		// again on a new connection, as HTTP clients do.
		res, _ = cl.try(id, body, stamped, true)
	}
	return res
}

// try sends the request once; stale says it failed on a reused
// connection before any byte of a response came.
func (cl *client) try(id string, body []byte, stamped, fresh bool) (res result, stale bool) {
	res = result{ID: id, TTFT: -1, TTFTKernel: -1}
	c, reused, err := cl.get(fresh)
	if err != nil {
		res.Err = err.Error()
		return res, false
	}
	if cl.timeout > 0 {
		c.c.SetDeadline(time.Now().Add(cl.timeout))
	}
	res.Start = time.Now()
	fmt.Fprintf(c.bw, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nX-Request-Id: %s\r\n%s\r\n",
		cl.path, cl.host, len(body), id, cl.headers)
	c.bw.Write(body)
	if err = c.bw.Flush(); err == nil {
		err = cl.read(c, &res, stamped)
	}
	if err == errClosed {
		c.c.Close()
		return res, false
	}
	if err != nil {
		var ne net.Error
		res.Timeout = errors.As(err, &ne) && ne.Timeout()
		res.Err = err.Error()
		c.c.Close()
		return res, reused && res.Bytes == 0 && res.Status == 0 && !res.Timeout
	}
	if cl.timeout > 0 {
		c.c.SetDeadline(time.Time{})
	}
	cl.put(c)
	return res, false
}

func (cl *client) read(c *conn, res *result, stamped bool) error {
	length, chunked, closeAfter, err := readHead(c, res)
	if err != nil {
		return err
	}
	c.p.Reset()
	b := &bodyReader{c: c, res: res, stamped: stamped, whole: !chunked && length >= 0}
	buf := make([]byte, 32<<10)
	switch {
	case chunked:
		err = b.chunked(buf)
	case length >= 0:
		if err = b.counted(buf, length); err == nil {
			o := dialect.OpenAI.Body(b.body)
			res.Output, res.Input = o.Out, o.In
		}
	default:
		err, closeAfter = b.toEOF(buf), true
	}
	if err != nil {
		return err
	}
	end := time.Now()
	res.E2E, res.E2EKernel = end.Sub(res.Start), receivedAt(c.c, end).Sub(res.Start)
	if res.Output == 0 {
		res.Output = len(res.Tokens)
	}
	if closeAfter {
		return errClosed
	}
	return nil
}

// readHead reads the response's status line and header: the status into
// res, and the body's framing.
func readHead(c *conn, res *result) (length int, chunked, closeAfter bool, err error) {
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return 0, false, false, err
	}
	res.TTFB = time.Since(res.Start)
	if len(line) < 12 {
		return 0, false, false, errStatus
	}
	res.Status, _ = strconv.Atoi(string(line[9:12]))
	length = -1
	for {
		h, err := c.br.ReadSlice('\n')
		if err != nil {
			return 0, false, false, err
		}
		h = bytes.TrimRight(h, "\r\n")
		if len(h) == 0 {
			return length, chunked, closeAfter, nil
		}
		k, v, _ := bytes.Cut(h, []byte(":"))
		v = bytes.TrimSpace(v)
		switch {
		case bytes.EqualFold(k, []byte("Content-Length")):
			length, _ = strconv.Atoi(string(v))
		case bytes.EqualFold(k, []byte("Transfer-Encoding")):
			chunked = bytes.EqualFold(v, []byte("chunked"))
		case bytes.EqualFold(k, []byte("Connection")):
			closeAfter = bytes.EqualFold(v, []byte("close"))
		}
	}
}

// bodyReader reads a response body, stamping each token event as it
// arrives (a body of known length is kept whole, for its usage).
type bodyReader struct {
	c       *conn
	res     *result
	stamped bool
	whole   bool
	body    []byte
}

// feed takes bytes of the body read now.
func (b *bodyReader) feed(p []byte) {
	now, res := time.Now(), b.res
	res.Bytes += len(p)
	if b.whole {
		b.body = append(b.body, p...)
		return
	}
	b.c.p.Feed(p)
	for b.c.p.Next() {
		ev := b.c.p.Event()
		o := dialect.OpenAI.Event(ev.Type, ev.Data)
		if o.Token {
			if res.TTFT < 0 {
				res.TTFT = now.Sub(res.Start)
				res.TTFTKernel = receivedAt(b.c.c, now).Sub(res.Start)
			}
			res.Tokens = append(res.Tokens, now.Sub(res.Start))
			if b.stamped {
				if sent := gjson.GetBytes(ev.Data, "mock_sent").Int(); sent > 0 {
					res.Delays = append(res.Delays, time.Duration(now.UnixNano()-sent))
				}
			}
		}
		if o.HasOut {
			res.Output = o.Out
		}
		if o.HasIn {
			res.Input = o.In
		}
	}
}

// chunked reads a chunked body to its last chunk and trailer.
func (b *bodyReader) chunked(buf []byte) error {
	br := b.c.br
	for {
		sz, err := br.ReadSlice('\n')
		if err != nil {
			return err
		}
		n, err := strconv.ParseInt(string(bytes.TrimSpace(bytes.SplitN(sz, []byte(";"), 2)[0])), 16, 64)
		if err != nil {
			return fmt.Errorf("bad chunk size %q", sz)
		}
		if n == 0 {
			_, err := br.ReadSlice('\n') // the trailer's end
			return err
		}
		if err := b.counted(buf, int(n)); err != nil {
			return err
		}
		if _, err := br.Discard(2); err != nil {
			return err
		}
	}
}

// counted reads n bytes of the body.
func (b *bodyReader) counted(buf []byte, n int) error {
	for n > 0 {
		m, err := b.c.br.Read(buf[:min(len(buf), n)])
		if m > 0 {
			b.feed(buf[:m])
		}
		if err != nil {
			return err
		}
		n -= m
	}
	return nil
}

// toEOF reads a body that ends with the connection.
func (b *bodyReader) toEOF(buf []byte) error {
	for {
		m, err := b.c.br.Read(buf)
		if m > 0 {
			b.feed(buf[:m])
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// errClosed: the response is complete but the connection cannot be reused.
var errClosed = errors.New("connection closed after response")
