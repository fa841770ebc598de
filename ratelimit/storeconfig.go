package ratelimit

import (
	"time"
)

// FailMode says what admission does when the store cannot answer within
// its timeout.
type FailMode string

const (
	// FailClosed refuses (503) while the store is down.
	FailClosed FailMode = "closed"
	// FailOpen falls back to each replica's own limiter, at the tenant's
	// limits divided by the live replicas (never below MinShare of them).
	FailOpen FailMode = "open"
)

// StoreConfig is a shared store.
type StoreConfig struct {
	Redis RedisConfig
	Fail  FailMode
	// LeaseTTL is how long a request's concurrency slot outlives a
	// replica that stopped renewing it (default 15 s).
	LeaseTTL time.Duration
	// MinShare floors each replica's share of a limit when it falls back
	// to its own limiter (FailOpen): limit × max(1/replicas, MinShare).
	MinShare float64
}

// RedisConfig is how to reach Redis.
type RedisConfig struct {
	Addr, Username, Password string
	DB                       int
	TLS                      bool
	// Timeout bounds every decision's store call (default 100 ms: a busy
	// host's scheduling delays pass 20 ms while Redis is healthy; a store
	// that stops answering costs the timeout only until the breaker
	// opens, tripAfter calls later).
	Timeout   time.Duration
	KeyPrefix string // default "tokentap:"
}

// The store's defaults and floors.
const (
	DefaultStoreTimeout = 100 * time.Millisecond
	MinLeaseTTL         = time.Second
)

func (s StoreConfig) withDefaults() StoreConfig {
	if s.Fail == "" {
		s.Fail = FailClosed
	}
	if s.LeaseTTL == 0 {
		s.LeaseTTL = 15 * time.Second
	}
	if s.Redis.Timeout == 0 {
		s.Redis.Timeout = DefaultStoreTimeout
	}
	if s.Redis.KeyPrefix == "" {
		s.Redis.KeyPrefix = "tokentap:"
	}
	return s
}

func (s *StoreConfig) validate() error {
	switch {
	case s.Redis.Addr == "":
		return fieldErr("admission.store.redis.addr", "is required")
	case s.Fail != "" && s.Fail != FailClosed && s.Fail != FailOpen:
		return fieldErr("admission.store.fail", "%q must be closed or open", s.Fail)
	case s.Redis.Timeout < 0:
		return fieldErr("admission.store.redis.timeout", "must not be negative")
	case s.Redis.Timeout != 0 && s.Redis.Timeout < time.Millisecond:
		return fieldErr("admission.store.redis.timeout", "%v is below 1ms: no store answers that fast", s.Redis.Timeout)
	case s.LeaseTTL < 0:
		return fieldErr("admission.store.lease_ttl", "must not be negative")
	case s.LeaseTTL != 0 && s.LeaseTTL < MinLeaseTTL:
		// Renewed every third of it: 1 ms would be ~1,000 calls a second
		// from an idle replica, and a 0 tick would stop every stream.
		return fieldErr("admission.store.lease_ttl", "%v is below %v (leases are renewed every third of it)", s.LeaseTTL, MinLeaseTTL)
	case s.MinShare < 0 || s.MinShare > 1:
		return fieldErr("admission.store.min_share", "must be between 0 and 1")
	case s.Redis.DB < 0:
		return fieldErr("admission.store.redis.db", "must not be negative")
	}
	return nil
}
