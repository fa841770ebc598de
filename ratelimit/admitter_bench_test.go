package ratelimit

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"
)

func manyTenants(n int) Config {
	cfg := Config{Mode: ModeReject}
	for i := range n {
		cfg.Tenants = append(cfg.Tenants, Tenant{
			Name:   fmt.Sprintf("tenant-%05d", i),
			Keys:   []string{fmt.Sprintf("sk-%05d", i)},
			Limits: Limits{RequestsPerSecond: 1e6, Burst: 1e6, TokensPerMinute: 1e12, MaxConcurrent: 1 << 20},
		})
	}
	return cfg
}

// BenchmarkAdmitRelease is one admission decision and its release, across
// 10,000 tenants with all three limits, keys looked up as the proxy does.
func BenchmarkAdmitRelease(b *testing.B) {
	cfg := manyTenants(10_000)
	a := New(cfg, nil, nil)
	defer a.Close()
	keys := make([][]byte, len(cfg.Tenants))
	for i, t := range cfg.Tenants {
		keys[i] = []byte(t.Keys[0])
	}
	ctx := context.Background()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		name, _ := a.Identify(keys[i%len(keys)])
		tk, ref := a.Admit(ctx, name, "chat", 500)
		if ref != nil {
			b.Fatal(ref)
		}
		tk.Release(400)
		i++
	}
}

// BenchmarkAdmitParallel is the same decision from all cores at once.
func BenchmarkAdmitParallel(b *testing.B) {
	cfg := manyTenants(10_000)
	a := New(cfg, nil, nil)
	defer a.Close()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			tk, ref := a.Admit(context.Background(), cfg.Tenants[i%len(cfg.Tenants)].Name, "chat", 500)
			if ref != nil {
				b.Error(ref)
				return
			}
			tk.Release(400)
			i++
		}
	})
}

// BenchmarkIdleTenantMemory reports the heap held per tenant: configured
// only (never seen), and with live limiter state (seen, not yet evicted).
func BenchmarkIdleTenantMemory(b *testing.B) {
	const n = 10_000
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	for b.Loop() {
		before := heap()
		cfg := manyTenants(n)
		a := New(cfg, time.Now, nil)
		configured := heap()
		for _, t := range cfg.Tenants {
			tk, _ := a.Admit(context.Background(), t.Name, "chat", 1)
			tk.Release(1)
		}
		live := heap()
		b.ReportMetric(float64(configured-before)/n, "B/tenant-configured")
		b.ReportMetric(float64(live-configured)/n, "B/tenant-state")
		runtime.KeepAlive(cfg)
		a.Close()
	}
}
