//go:build linux

package proxy

import (
	"os"
	"testing"

	"github.com/tokentap/tokentap/proxy/testkit/netsim"
)

// TestMain lets this test binary serve as a netsim link's forwarder, as
// the clients on the link's far side (network_test.go) and as the busy
// machine's simulated server (busy_test.go): processes of their own.
func TestMain(m *testing.M) {
	netsim.ServeForwarder()
	serveNetClients()
	serveMockChild()
	os.Exit(m.Run())
}
