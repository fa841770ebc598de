package upstream

import (
	"time"

	"github.com/tokentap/tokentap/proxy/internal/conf"
)

// Timeouts bound the upstream side of an exchange. None of them limits the
// total length of a response: a long, healthy stream is never cut.
type Timeouts struct {
	// Connect bounds dialing (and the TLS handshake) to the upstream.
	Connect time.Duration
	// Write bounds writing the request to the upstream.
	Write time.Duration
	// FirstByte bounds the wait from the request written to the first byte
	// of the response: the backend's queueing and prefill.
	FirstByte time.Duration
	// Idle bounds the gap between two reads of the response body.
	Idle time.Duration
	// IdleConn is how long an unused keep-alive connection stays pooled;
	// it is closed then, with or without traffic. The backend's own
	// Keep-Alive header (timeout, max) shortens it. Every pooled connection
	// is checked before reuse (one non-consuming peek): one the backend
	// closed is replaced, one with unread bytes is closed. A request the
	// backend provably never received (reset before it acknowledged a byte
	// of it) is sent again once on a new connection; one it received never
	// is.
	IdleConn time.Duration
	// MaxIdleConns caps the pooled idle connections per upstream.
	MaxIdleConns int
	// MaxConns caps the open connections per upstream (0: no cap). Every
	// live stream holds one.
	MaxConns int
}

// Validate checks that every timeout is set (a zero one would mean
// "never") and the pool bounds are not negative; errors are *FieldError
// under path (the key of these timeouts in the config file).
func (t Timeouts) Validate(path string) error {
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"connect", t.Connect}, {"write", t.Write}, {"first_byte", t.FirstByte}, {"idle", t.Idle}, {"idle_conn", t.IdleConn}} {
		if d.v <= 0 {
			return conf.Errf(path+"."+d.name, "must be positive (leave it out for the default)")
		}
	}
	switch {
	case t.MaxIdleConns < 0:
		return conf.Errf(path+".max_idle_conns", "must not be negative")
	case t.MaxConns < 0:
		return conf.Errf(path+".max_conns", "must not be negative")
	}
	return nil
}

// DefaultTimeouts are the timeouts used where the config says nothing.
var DefaultTimeouts = Timeouts{
	Connect:   5 * time.Second,
	Write:     30 * time.Second,
	FirstByte: 10 * time.Minute,
	Idle:      2 * time.Minute,
	// As Go's http.Transport. A short lifetime would make the first burst
	// after every lull dial anew: a dial costs tokentap several times a
	// request's CPU, and the burst's first tokens wait behind it.
	IdleConn:     90 * time.Second,
	MaxIdleConns: 1024,
	MaxConns:     0,
}
