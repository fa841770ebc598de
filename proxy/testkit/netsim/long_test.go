package netsim

import "testing"

// long skips a long test under -short and says, as it starts (go test
// -v), what it waits for.
func long(t *testing.T, what string) {
	if t.Helper(); testing.Short() {
		t.Skip("long: " + what + " (go test without -short runs it)")
	}
	t.Log("waits for " + what)
}
