package ratelimit

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"
)

// keyIndex maps API keys to tenant names. Keys given as SHA-256 digests are
// matched by hashing the presented key; the presented key itself is never
// stored or returned.
type keyIndex struct {
	plain  map[string]string
	hashed map[[32]byte]string
}

func newKeyIndex(tenants []Tenant) keyIndex {
	ki := keyIndex{plain: map[string]string{}, hashed: map[[32]byte]string{}}
	for _, t := range tenants {
		for _, k := range t.Keys {
			ki.plain[k] = t.Name
		}
		for _, h := range t.KeySHA256 {
			var d [32]byte
			if _, err := hex.Decode(d[:], []byte(strings.ToLower(h))); err == nil {
				ki.hashed[d] = t.Name
			}
		}
	}
	return ki
}

// lookup returns the tenant of key. It does not allocate.
func (ki keyIndex) lookup(key []byte) (string, bool) {
	if name, ok := ki.plain[string(key)]; ok {
		return name, true
	}
	if len(ki.hashed) == 0 {
		return "", false
	}
	name, ok := ki.hashed[sha256.Sum256(key)]
	return name, ok
}
