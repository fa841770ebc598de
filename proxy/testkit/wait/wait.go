// Package wait is how the relay's tests wait for an event: For polls a
// condition until it holds. Its one limit is a hang's (a minute), never a
// slow machine's, and on a hang the test fails with the condition's last
// word on what it saw. Every wait for a state the relay reaches on its own
// goes through here, in every package of proxy/.
package wait

import (
	"errors"
	"testing"
	"time"
)

// For polls cond until it returns nil, failing t after a minute with
// cond's last error.
func For(t testing.TB, cond func() error) {
	t.Helper()
	var err error
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(2 * time.Millisecond) {
		if err = cond(); err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not within a minute: %v", err)
		}
	}
}

// Until is For for a condition with nothing to say.
func Until(t testing.TB, cond func() bool) {
	t.Helper()
	For(t, func() error {
		if cond() {
			return nil
		}
		return errors.New("the condition still does not hold")
	})
}

// Long skips a long test under -short and says, as it starts (go test
// -v), what it waits for.
func Long(t *testing.T, what string) {
	if t.Helper(); testing.Short() {
		t.Skip("long: " + what + " (go test without -short runs it)")
	}
	t.Log("waits for " + what)
}
