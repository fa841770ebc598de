package upstream

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/tokentap/tokentap/proxy/internal/conf"
	"golang.org/x/net/http/httpproxy"
)

// TLS is how a route's https upstreams are trusted and how tokentap
// presents itself to them. The files are read when the config is applied
// (a reload reads them again).
type TLS struct {
	// CAFile holds the PEM certificates of the CAs trusted for the
	// upstreams, instead of the system's roots.
	CAFile string
	// CertFile and KeyFile are tokentap's client certificate (mTLS to the
	// backend), both or neither.
	CertFile, KeyFile string
	// ServerName is the name the upstreams' certificates are checked
	// against (and sent in SNI), instead of the URL's host.
	ServerName string
	// InsecureSkipVerify accepts any certificate: for tests only; a
	// warning is logged whenever a config with it is applied.
	InsecureSkipVerify bool
}

// Check reads and checks what u names, for a config's validation: the
// field at fault (ca_file, cert_file) and why.
func (u *TLS) Check() (field string, err error) {
	if _, ferr := u.config(); ferr != nil {
		return ferr.field, ferr.err
	}
	return "", nil
}

// tlsFieldError names the field of TLS that is wrong.
type tlsFieldError struct {
	field string
	err   error
}

// config builds the part of the upstreams' TLS config the route sets.
func (u *TLS) config() (*tls.Config, *tlsFieldError) {
	c := &tls.Config{ServerName: u.ServerName, InsecureSkipVerify: u.InsecureSkipVerify} //nolint:gosec // the operator's choice, logged
	if u.CAFile != "" {
		pem, err := os.ReadFile(u.CAFile)
		if err != nil {
			return nil, &tlsFieldError{"ca_file", err}
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, &tlsFieldError{"ca_file", errors.New("holds no PEM certificate")}
		}
	}
	if (u.CertFile == "") != (u.KeyFile == "") {
		return nil, &tlsFieldError{"cert_file", errors.New("cert_file and key_file go together")}
	}
	if u.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(u.CertFile, u.KeyFile)
		if err != nil {
			return nil, &tlsFieldError{"cert_file", errors.New("cannot load the certificate and key: " + conf.DescribeFileError(err))}
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// upstreamTLSConfig is the TLS config of an https upstream at host, under
// the route's settings (nil: none).
func upstreamTLSConfig(host string, rt *TLS) (*tls.Config, error) {
	c := &tls.Config{ServerName: host, MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
	if rt == nil {
		return c, nil
	}
	r, ferr := rt.config()
	if ferr != nil {
		return nil, fmt.Errorf("tls.%s: %w", ferr.field, ferr.err)
	}
	c.RootCAs, c.Certificates, c.InsecureSkipVerify = r.RootCAs, r.Certificates, r.InsecureSkipVerify
	if r.ServerName != "" {
		c.ServerName = r.ServerName
	}
	return c, nil
}

// proxyFor is the forward proxy the environment names for an upstream
// (HTTPS_PROXY for https, HTTP_PROXY for http, NO_PROXY's exceptions), as
// net/http reads them: nil for none. Loopback addresses never go through
// one.
func proxyFor(scheme, addr string) (*url.URL, error) {
	return httpproxy.FromEnvironment().ProxyFunc()(&url.URL{Scheme: scheme, Host: addr})
}

// maxConnectResponse bounds the forward proxy's answer to CONNECT.
const maxConnectResponse = 8 << 10

// connectThrough opens a tunnel to addr through the forward proxy on conn
// (CONNECT, with the proxy URL's credentials), within ctx. The answer is
// read byte by byte up to its blank line, so no byte of the tunnel is
// read ahead.
func connectThrough(ctx context.Context, conn net.Conn, proxy *url.URL, addr string) error {
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
		defer conn.SetDeadline(time.Time{})
	}
	req := "CONNECT " + addr + " HTTP/1.1\r\nHost: " + addr + "\r\n"
	if u := proxy.User; u != nil {
		pass, _ := u.Password()
		req += "Proxy-Authorization: Basic " + base64.StdEncoding.EncodeToString([]byte(u.Username()+":"+pass)) + "\r\n"
	}
	if _, err := conn.Write([]byte(req + "\r\n")); err != nil {
		return err
	}
	var head []byte
	b := make([]byte, 1)
	for len(head) < maxConnectResponse {
		if _, err := conn.Read(b); err != nil {
			return fmt.Errorf("forward proxy: %w", err)
		}
		head = append(head, b[0])
		if len(head) >= 4 && string(head[len(head)-4:]) == "\r\n\r\n" {
			resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(head)), nil)
			if err != nil {
				return errors.New("forward proxy: unreadable answer to CONNECT")
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				return fmt.Errorf("forward proxy refused the tunnel: status %d", resp.StatusCode)
			}
			return nil
		}
	}
	return errors.New("forward proxy: answer to CONNECT too large")
}
