package routing

import (
	"cmp"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/tidwall/gjson"
)

// Prefix affinity (sticky: prefix): requests whose prompts begin alike go
// to the same upstream, where its prefix cache holds the prompt's blocks
// (the ring and the keys hashed alike in every process: replicas agree),
// with the load bounded: consistent hashing with bounded loads (Mirrokni,
// Thorup and Zadimoghaddam), each upstream holding at most affinityLoad
// times its weight's share of the route's requests in flight. A key stays
// on its upstream while that one is within its bound; past it the key
// moves to the next on the ring with room (byPrefix). The load is what is
// in flight, not how many requests were sent: a prefix that dominates a
// route's traffic stays where it is cached while its upstream keeps up,
// however many requests it brings one after another (it was spread over
// every upstream, each a cache miss, with one request in flight).

// affinityLoad is the bound: no upstream is given more than this many
// times its weight's share of the route's requests in flight.
const affinityLoad = 1.25

// maxPrefixBytes bounds the bytes of a prompt hashed into its key.
const maxPrefixBytes = 4096

// ringPointsPerUpstream is each upstream's points on the ring at the
// largest weight (fewer, in proportion, for smaller weights).
const ringPointsPerUpstream = 160

// ringPoint is one place on the ring and the index of the upstream it
// belongs to.
type ringPoint struct {
	hash uint64
	at   int
}

// affinity is a sticky: prefix route's ring and where each key seen
// lately was sent: a key stays on its upstream until that one passes its
// bound, and then moves, as a whole, to the next on the ring with room,
// so that each prompt is cached on one upstream rather than spread.
type affinity struct {
	ring []ringPoint
	mu   sync.Mutex
	load []int64 // each upstream's requests in flight, read as a pick begins
	keys map[uint64]placed
}

// placed is where a key was sent, and when last.
type placed struct {
	at   int
	seen time.Time
}

// The key table's bounds: at most maxAffinityKeys keys (past it, keys
// idle for affinityIdle are dropped; a new key finds no room and is placed
// by the ring alone).
const (
	maxAffinityKeys = 16384
	affinityIdle    = 10 * time.Minute
)

// newAffinity places each member with a weight on the ring, its points in
// proportion to its weight.
func newAffinity(members []*Member) *affinity {
	most := 0
	for _, m := range members {
		most = max(most, m.Weight)
	}
	a := &affinity{load: make([]int64, len(members)), keys: map[uint64]placed{}}
	for i, m := range members {
		if m.Weight == 0 {
			continue
		}
		name := m.Name
		if name == "" {
			name = strconv.Itoa(i)
		}
		for j := range max(1, ringPointsPerUpstream*m.Weight/most) {
			a.ring = append(a.ring, ringPoint{hash: xxhash.Sum64String(name + "#" + strconv.Itoa(j)), at: i})
		}
	}
	slices.SortFunc(a.ring, func(x, y ringPoint) int { return cmp.Compare(x.hash, y.hash) })
	return a
}

// waitsForNone reports that m's model predicts a request sent with k in
// flight there a first token within a tenth (and a millisecond) of an idle
// upstream's: the batch has room for it. Nothing believed: false.
func waitsForNone(m *Member, k int64) bool {
	model := m.Up.Gate.Model
	idle, _, ok := model.Predict(0, -1)
	if !ok {
		return false
	}
	at, _, _ := model.Predict(int(k)+1, -1)
	return at <= idle+max(idle/10, time.Millisecond)
}

// place remembers that key was sent to upstream i at now, within the
// table's bound.
func (a *affinity) place(key uint64, i int, now time.Time) {
	if _, ok := a.keys[key]; !ok && len(a.keys) >= maxAffinityKeys {
		for k, p := range a.keys {
			if now.Sub(p.seen) > affinityIdle {
				delete(a.keys, k)
			}
		}
		if len(a.keys) >= maxAffinityKeys {
			return
		}
	}
	a.keys[key] = placed{at: i, seen: now}
}

// promptKey hashes the beginning of a request's prompt, the part that
// requests of one application share: the system prompt and every message
// but the last (the new turn); a prompt of one message, or a completion's
// prompt, by its first bytes; at most maxPrefixBytes in all. ok is false
// for a body without a prompt.
func promptKey(body []byte) (key uint64, ok bool) {
	// The fields it reads, found in one pass over the body's top level.
	var system [3]gjson.Result // system, systemInstruction, instructions
	var conv, prompt gjson.Result
	gjson.ParseBytes(body).ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "system":
			system[0] = v
		case "systemInstruction":
			system[1] = v
		case "instructions":
			system[2] = v
		case "messages", "contents":
			if !conv.IsArray() && v.IsArray() {
				conv = v
			}
		case "input":
			if v.IsArray() && !conv.IsArray() {
				conv = v
			} else if v.Type == gjson.String && prompt.Type != gjson.String {
				prompt = v
			}
		case "prompt":
			if v.Type == gjson.String {
				prompt = v
			}
		}
		return true
	})
	h := xxhash.New()
	left := maxPrefixBytes
	add := func(raw string) {
		if left <= 0 {
			return
		}
		if len(raw) > left {
			raw = raw[:left]
		}
		h.WriteString(raw)
		left -= len(raw)
		ok = true
	}
	for _, v := range system {
		if v.Exists() {
			add(v.Raw)
		}
	}
	switch msgs := conv.Array(); {
	case conv.IsArray() && len(msgs) == 1 && !ok:
		add(msgs[0].Raw) // one message: its first bytes
	case conv.IsArray() && len(msgs) > 1:
		for _, m := range msgs[:len(msgs)-1] {
			add(m.Raw) // with a system prompt alone, that is the shared part
		}
	case !conv.IsArray() && prompt.Type == gjson.String:
		add(prompt.Str)
	}
	return h.Sum64(), ok
}

// CacheTally is what an upstream's backend said of its prompt cache: the
// requests that reported cached tokens, those with some (a hit), and the
// first-token times of each kind (microseconds summed), for /stats.
type CacheTally struct {
	reported, hits        atomic.Int64
	hitTTFTus, missTTFTus atomic.Int64
	hitTTFTn, missTTFTn   atomic.Int64
}

// Note counts a finished request's cached tokens (negative: not
// reported) and its TTFT (negative: none).
func (c *CacheTally) Note(cached int, ttftUS int64) {
	if cached < 0 {
		return
	}
	c.reported.Add(1)
	if cached > 0 {
		c.hits.Add(1)
		if ttftUS >= 0 {
			c.hitTTFTus.Add(ttftUS)
			c.hitTTFTn.Add(1)
		}
	} else if ttftUS >= 0 {
		c.missTTFTus.Add(ttftUS)
		c.missTTFTn.Add(1)
	}
}
