package downstream

import (
	"crypto/tls"
	"errors"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/metrics"
)

// TLSConn is a client connection over TLS. The TLS layer reads and
// writes through its Conn (the socket: receive stamps, the count of
// bytes written and of the writes that waited, TCP_INFO, the caps), and
// what the Conn does with the plain text (bytes read ahead and
// handed back, the scan of the request header) is done here, on the plain
// text. Its responses are written by the server (the body stream): the
// responses tokentap writes itself on a hijacked connection and the relay
// loops write to the socket, and are for plain connections only.
//
// Owner: the goroutine serving the connection, as for a Conn.
type TLSConn struct {
	*tls.Conn
	cc    *Conn
	shook bool
}

// tlsSocket is what the TLS layer reads and writes: the socket, stamped.
type tlsSocket struct{ *Conn }

func (s tlsSocket) Read(b []byte) (int, error) { return (*socketSide)(s.Conn).Read(b) }

func newTLSConn(cc *Conn, cfg *tls.Config) *TLSConn {
	return &TLSConn{Conn: tls.Server(tlsSocket{cc}, cfg), cc: cc}
}

// Read reads the plain text. The handshake comes first: its reads are not
// the request's, whose arrival is the stamp of the first read after it.
func (t *TLSConn) Read(b []byte) (int, error) {
	if !t.shook {
		if err := t.Conn.Handshake(); err != nil {
			return 0, handshakeError{err}
		}
		t.shook = true
		// If the request came in the handshake's last read, it is read
		// now and gets now: microseconds late, where that read's stamp
		// would count a client's wait after the handshake.
		t.cc.reqRx = 0
		if t.ConnectionState().NegotiatedProtocol == "h2" {
			t.cc.toH2(nil)
		}
	}
	return t.cc.readPlain(b, t.Conn)
}

// Raw gives the peer watch and TCP_INFO the socket.
func (t *TLSConn) Raw() syscall.RawConn { return t.cc.Sys }

// Of returns the Conn under c (plain or TLS), or nil.
func Of(c net.Conn) *Conn {
	switch c := c.(type) {
	case *Conn:
		return c
	case *TLSConn:
		return c.cc
	}
	return nil
}

// plainHTTPOnTLS is the answer to a plain HTTP request on a TLS port.
var plainHTTPOnTLS = func() []byte {
	body := `{"error":{"type":"tokentap_error","code":"plain_http_to_tls_port","message":"this port speaks TLS: send the request over https"}}` + "\n"
	return []byte("HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\n\r\n" + body)
}()

// AnswerPlainHTTP answers 400 in plain text, on the socket under the TLS
// layer, when err is a handshake that failed because its first bytes were
// a plain HTTP request (Go's net/http server does the same), and reports
// whether it did. The admin listener's error handler calls it too.
func AnswerPlainHTTP(err error) bool {
	var re tls.RecordHeaderError
	if !errors.As(err, &re) || re.Conn == nil || !looksLikeHTTP(re.RecordHeader[:]) {
		return false
	}
	metrics.PlainHTTPOnTLS()
	_ = re.Conn.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = re.Conn.Write(plainHTTPOnTLS)
	return true
}

// looksLikeHTTP says a TLS record header is the start of an HTTP method.
func looksLikeHTTP(h []byte) bool {
	for _, m := range []string{"GET ", "HEAD ", "POST ", "PUT ", "PATCH ", "DELETE ", "OPTIONS ", "CONNECT ", "TRACE "} {
		if n := min(len(h), len(m)); string(h[:n]) == m[:n] {
			return true
		}
	}
	return false
}

// IsHandshakeError reports a failed TLS handshake (no request was read).
func IsHandshakeError(err error) bool { return errors.As(err, new(handshakeError)) }

// handshakeError is a failed TLS handshake: no request was read, none is
// recorded (the server's error handler counts it).
type handshakeError struct{ err error }

func (e handshakeError) Error() string { return "tls handshake: " + e.err.Error() }
func (e handshakeError) Unwrap() error { return e.err }
