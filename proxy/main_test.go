//go:build linux

package proxy

import (
	"os"
	"testing"

	"github.com/tokentap/tokentap/proxy/internal/netsim"
)

// TestMain lets this test binary serve as a netsim link's forwarder, and
// as the clients on the link's far side (network_test.go): processes of
// their own, and as TestMonitorTickPreemptsLongWork's client.
func TestMain(m *testing.M) {
	netsim.ServeForwarder()
	serveNetClients()
	serveMonitorClient()
	os.Exit(m.Run())
}
