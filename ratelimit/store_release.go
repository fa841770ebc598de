package ratelimit

import (
	"context"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// Releases: sent by the store's goroutine as they come, pipelined; kept
// and sent again when the store is down or a call fails.

// releaseOp is a release waiting to be sent, since when.
type releaseOp struct {
	tenant, route    string
	lease            string
	all, rl          Limits // zero: none
	hasRoute         bool
	reserved, actual usage
	since            time.Time
}

// A release that could not be sent (the store down, a call that failed)
// is sent again at the next flush, for up to releaseRetryFor: within the
// time its script's mark of having landed is kept (300 s), so one that
// did land is not counted twice. Past it, or past maxUnsent waiting, it
// is dropped and counted; its lease has run out by then on its own.
const (
	releaseRetryFor = 4 * time.Minute
	maxUnsent       = 100_000
)

// release ends an admitted request: its lease goes and its token
// reservations are reconciled with actual. It does not wait: the store's
// goroutine sends it (to the store that took the leases over, after a
// reload that changed the store).
func (s *store) release(tenant, route string, all, rl *Limits, lease string, reserved, actual usage) {
	s.mu.Lock()
	for s.next != nil {
		n := s.next
		if !sameTarget(s.cfg, n.cfg) {
			reserved, actual = usage{}, usage{}
		}
		s.mu.Unlock()
		s = n
		s.mu.Lock()
	}
	delete(s.leases, lease)
	op := releaseOp{tenant: tenant, route: route, lease: lease, hasRoute: rl != nil, reserved: reserved, actual: actual, since: time.Now()}
	if all != nil {
		op.all = *all
	}
	if rl != nil {
		op.rl = *rl
	}
	s.releases = append(s.releases, op)
	s.releasingAdd(&op)
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// flush sends the releases waiting, pipelined. Those that cannot be sent
// (the store down, a call that failed) wait for the next flush
// (releaseRetryFor).
func (s *store) flush() {
	s.mu.Lock()
	ops := s.releases
	s.releases = nil
	s.mu.Unlock()
	var unsent []releaseOp
	for len(ops) > 0 {
		batch := ops[:min(len(ops), releaseBatch)]
		ops = ops[len(batch):]
		if !s.up.Load() || s.sendReleases(batch) != nil {
			unsent = append(unsent, batch...)
			continue
		}
		s.mu.Lock()
		for i := range batch {
			s.confirmed(&batch[i])
		}
		s.mu.Unlock()
	}
	if len(unsent) == 0 {
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	kept := unsent[:0]
	for i := range unsent {
		if now.Sub(unsent[i].since) > releaseRetryFor || len(kept)+len(s.releases) >= maxUnsent {
			s.dropped.Add(1)
			s.confirmed(&unsent[i])
			continue
		}
		kept = append(kept, unsent[i])
	}
	s.retried.Add(int64(len(kept)))
	s.releases = append(kept, s.releases...) // first in line, in their order
}

// sendReleases sends batch in one pipeline.
func (s *store) sendReleases(batch []releaseOp) error {
	return s.call(s.background(), func(ctx context.Context) error {
		pipe := s.c.Pipeline()
		for i := range batch {
			keys, args := s.releaseCall(&batch[i])
			releaseScript.EvalSha(ctx, pipe, keys, args...)
		}
		_, err := pipe.Exec(ctx)
		if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			// The store restarted and lost its scripts: load them once.
			if err = releaseScript.Load(ctx, s.c).Err(); err == nil {
				_, err = pipe.Exec(ctx)
			}
		}
		return err
	})
}

// releasingAdd counts op among its tenant's releases on their way. s.mu
// is held.
func (s *store) releasingAdd(op *releaseOp) {
	r := s.releasing[op.tenant]
	if r == nil {
		r = &releasing{}
		s.releasing[op.tenant] = r
	}
	r.n++
	back := op.reserved.tokens - op.actual.tokens
	if len(r.pending) < maxReleasing {
		r.pending = append(r.pending, pendingRelease{lease: op.lease, back: back, route: op.route, hasRoute: op.hasRoute})
	}
	r.credit += back
	if op.hasRoute && back != 0 {
		if r.routeCredit == nil {
			r.routeCredit = map[string]int64{}
		}
		r.routeCredit[op.route] += back
	}
}

// confirmed forgets op among its tenant's releases on their way, sent (or
// dropped). s.mu is held.
func (s *store) confirmed(op *releaseOp) {
	r := s.releasing[op.tenant]
	if r == nil {
		return
	}
	if r.n--; r.n == 0 {
		delete(s.releasing, op.tenant)
		return
	}
	if i := slices.IndexFunc(r.pending, func(p pendingRelease) bool { return p.lease == op.lease }); i >= 0 {
		r.pending = slices.Delete(r.pending, i, i+1)
	}
	back := op.reserved.tokens - op.actual.tokens
	r.credit -= back
	if op.hasRoute && back != 0 {
		if r.routeCredit[op.route] -= back; r.routeCredit[op.route] == 0 {
			delete(r.routeCredit, op.route)
		}
	}
}

func (s *store) releaseCall(op *releaseOp) ([]string, []any) {
	keys := s.bases(op.tenant, op.route, op.hasRoute)
	args := []any{op.lease, op.reserved.tokens, op.actual.tokens, op.reserved.micro, op.actual.micro}
	args = limitArgs(args, op.all)
	if op.hasRoute {
		args = limitArgs(args, op.rl)
	}
	return keys, args
}
