package downstream

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/conf"
)

// ServerTLSFiles are a listener's TLS settings: its certificate and key,
// and the CAs its clients' certificates must come from (mTLS; empty: no
// client certificate asked for).
type ServerTLSFiles struct {
	CertFile, KeyFile string
	ClientCAFile      string
	MinVersion        uint16 // tls.VersionTLS12 (default) or tls.VersionTLS13
}

// ServerTLS serves a listener's TLS config from its files: read at start,
// again on Reload (a config reload) and whenever Watch sees them change,
// so a renewed certificate needs no restart. A read that fails keeps the
// config in use.
type ServerTLS struct {
	mu    sync.Mutex // Reload and Watch
	files ServerTLSFiles
	cur   atomic.Pointer[tls.Config]
}

// NewServerTLS reads the files.
func NewServerTLS(f ServerTLSFiles) (*ServerTLS, error) {
	s := &ServerTLS{}
	if err := s.Reload(f); err != nil {
		return nil, err
	}
	return s, nil
}

// LoadServerTLS reads and checks f, for a config's validation; its errors
// name the field (cert_file, key_file, client_ca_file).
func LoadServerTLS(f ServerTLSFiles) (*tls.Config, error) {
	if f.CertFile == "" || f.KeyFile == "" {
		return nil, errors.New("cert_file and key_file are both needed")
	}
	cert, err := tls.LoadX509KeyPair(f.CertFile, f.KeyFile)
	if err != nil {
		return nil, fmt.Errorf("cert_file, key_file: cannot load the certificate and key: %s", conf.DescribeFileError(err))
	}
	c := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: f.MinVersion, NextProtos: []string{"h2", "http/1.1"}}
	if c.MinVersion == 0 {
		c.MinVersion = tls.VersionTLS12
	}
	if f.ClientCAFile != "" {
		pem, err := os.ReadFile(f.ClientCAFile)
		if err != nil {
			return nil, fmt.Errorf("client_ca_file: %w", err)
		}
		c.ClientCAs = x509.NewCertPool()
		if !c.ClientCAs.AppendCertsFromPEM(pem) {
			return nil, errors.New("client_ca_file: holds no PEM certificate")
		}
		c.ClientAuth = tls.RequireAndVerifyClientCert
	}
	return c, nil
}

// Reload reads f (the same files, or those of a new config) and serves
// them from the next handshake on.
func (s *ServerTLS) Reload(f ServerTLSFiles) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.load(f)
}

func (s *ServerTLS) load(f ServerTLSFiles) error {
	c, err := LoadServerTLS(f)
	if err != nil {
		return err
	}
	s.files = f
	s.cur.Store(c)
	return nil
}

// Config is the listener's tls.Config: each handshake takes the files'
// config in use then.
func (s *ServerTLS) Config() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) { return s.cur.Load(), nil },
	}
}

// Watch looks at the files every interval until ctx is done and reloads
// them when one changed (its size, time or inode: a Kubernetes secret
// swaps a symbolic link). onLoad is told each reload, nil when the new
// files are served (Serving says what), or why they are not (the config in
// use stays); a failed change is told once.
func (s *ServerTLS) Watch(ctx context.Context, every time.Duration, onLoad func(error)) {
	paths := func() []string {
		s.mu.Lock()
		defer s.mu.Unlock()
		return []string{s.files.CertFile, s.files.KeyFile, s.files.ClientCAFile}
	}
	WatchFiles(ctx, every, paths, func() {
		s.mu.Lock()
		err := s.load(s.files)
		s.mu.Unlock()
		if onLoad != nil {
			onLoad(err)
		}
	})
}

// Serving describes the certificate served now, for logs: its serial
// number, subject and expiry (no key material).
func (s *ServerTLS) Serving() (serial, subject string, notAfter time.Time) {
	c := s.cur.Load()
	if c == nil || len(c.Certificates) == 0 || c.Certificates[0].Leaf == nil {
		return "", "", time.Time{}
	}
	leaf := c.Certificates[0].Leaf
	return leaf.SerialNumber.String(), leaf.Subject.String(), leaf.NotAfter
}

// WatchFiles calls changed each time FileStamp of paths() differs from
// what it was at the previous look, looking every interval until ctx is
// done.
func WatchFiles(ctx context.Context, every time.Duration, paths func() []string, changed func()) {
	seen := FileStamp(paths()...)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if now := FileStamp(paths()...); now != seen {
			seen = now
			changed()
		}
	}
}

// FileStamp identifies files' contents cheaply: the size, modification
// time and inode of each (symbolic links followed), "missing" for one
// that cannot be read; empty paths are skipped.
func FileStamp(paths ...string) string {
	var out []byte
	for _, p := range paths {
		if p == "" {
			continue
		}
		fi, err := os.Stat(p)
		if err != nil {
			out = append(out, "missing;"...)
			continue
		}
		var ino uint64
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			ino = st.Ino
		}
		out = fmt.Appendf(out, "%d:%d:%d;", fi.Size(), fi.ModTime().UnixNano(), ino)
	}
	return string(out)
}
