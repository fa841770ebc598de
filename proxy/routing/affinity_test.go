package routing

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/upstream"
)

// TestPromptKey: the key is the shared beginning of a prompt: the system
// prompt and every message but the last; a one-message prompt by its first
// bytes; a completion's prompt; nothing for a body without one.
func TestPromptKey(t *testing.T) {
	key := func(b string) uint64 {
		k, ok := promptKey([]byte(b))
		if !ok {
			t.Fatalf("no key for %s", b)
		}
		return k
	}
	a1 := key(`{"messages":[{"role":"system","content":"A"},{"role":"user","content":"q1"}]}`)
	a2 := key(`{"messages":[{"role":"system","content":"A"},{"role":"user","content":"q2"}]}`)
	b1 := key(`{"messages":[{"role":"system","content":"B"},{"role":"user","content":"q1"}]}`)
	if a1 != a2 || a1 == b1 {
		t.Errorf("chat keys: same system %v, other system %v", a1 == a2, a1 == b1)
	}
	if key(`{"system":"S","messages":[{"role":"user","content":"x"}]}`) != key(`{"system":"S","messages":[{"role":"user","content":"y"}]}`) {
		t.Error("Anthropic: the system prompt is the shared part")
	}
	long := strings.Repeat("x", 2*maxPrefixBytes)
	if key(`{"prompt":"`+long+`1"}`) != key(`{"prompt":"`+long+`2"}`) {
		t.Error("a prompt's bytes past maxPrefixBytes changed its key")
	}
	if _, ok := promptKey([]byte(`{"model":"m"}`)); ok {
		t.Error("a body without a prompt has a key")
	}
	if _, ok := promptKey([]byte(`{"messages":[]}`)); ok {
		t.Error("an empty conversation has a key")
	}
}

// TestRingBoundsLoad: keys spread over every upstream, and keep theirs
// while the loads stay in bounds; one key sent again and again takes its
// home upstream's bound there, and spills.
func TestRingBoundsLoad(t *testing.T) {
	members := affinityMembers(t, 4)
	r := NewSet(members, Options{Sticky: StickyPrefix}, time.Unix(1000, 0))
	now := time.Unix(1000, 0)
	home := map[uint64]*Member{}
	seen := map[*Member]int{}
	for k := range uint64(1000) {
		key := k * 0x9e3779b97f4a7c15
		home[key], _ = r.byPrefix(key, now)
		seen[home[key]]++
	}
	for _, m := range members {
		if seen[m] < 150 {
			t.Errorf("upstream %s is home to %d of 1000 keys", m.Name, seen[m])
		}
	}
	for k := range uint64(400) {
		key := (k % 100) * 0x9e3779b97f4a7c15
		if m, _ := r.byPrefix(key, now); m != home[key] {
			t.Fatalf("key %d left its home with nothing in flight", k%100)
		}
	}
	// A hot key, one request at a time: it stays where it is cached.
	seven := uint64(7)
	hot := seven * 0x9e3779b97f4a7c15 // a key of the spread above
	for range 400 {
		if m, _ := r.byPrefix(hot, now); m != home[hot] {
			t.Fatal("a hot key sent one at a time left its home")
		}
	}
	// Its home holding 4 in flight, the others none: past its bound
	// (1.25 x 5/4 + 1), the key moves to the next on the ring, and stays
	// there while its home is over it; back once it is not.
	home[hot].Up.Inflight.Store(4)
	next, why := r.byPrefix(hot, now)
	if next == home[hot] || why != pickSpill {
		t.Fatalf("over its bound the hot key's home still got it (%s)", reasonNames[why])
	}
	if again, _ := r.byPrefix(hot, now); again != next {
		t.Errorf("the spilled key moved again: %s then %s", next.Name, again.Name)
	}
	next.Up.Inflight.Store(2)
	if m, _ := r.byPrefix(hot, now); m != next {
		t.Errorf("within its bound (2 of 6 in flight) the key left %s for %s", next.Name, m.Name)
	}
}

// affinityMembers are n upstreams of weight 1, their in-flight counts
// the test's to set.
func affinityMembers(t *testing.T, n int) []*Member {
	var members []*Member
	for i := range n {
		up, err := upstream.New("http://127.0.0.1:1", upstream.DefaultTimeouts, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		members = append(members, &Member{Name: fmt.Sprintf("u%d", i), Up: up, Weight: 1})
	}
	return members
}

// TestAffinityTableBounded: the key table never holds more than
// maxAffinityKeys; idle keys make room for new ones.
func TestAffinityTableBounded(t *testing.T) {
	members := affinityMembers(t, 2)
	r := NewSet(members, Options{Sticky: StickyPrefix}, time.Unix(1000, 0))
	now := time.Unix(1000, 0)
	for k := range uint64(maxAffinityKeys + 500) {
		r.byPrefix(k*2654435761, now)
	}
	if n := len(r.aff.keys); n != maxAffinityKeys {
		t.Errorf("table holds %d keys, want the bound %d", n, maxAffinityKeys)
	}
	now = now.Add(affinityIdle + time.Second)
	r.byPrefix(1, now)
	if n := len(r.aff.keys); n != 1 {
		t.Errorf("after every key idled, the table holds %d keys, want the new one alone", n)
	}
}
