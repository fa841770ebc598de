package relayplane

import "testing"

// deepWork stands for a request's work on a fresh goroutine: depth frames
// of about 512 bytes each.
//
//go:noinline
func deepWork(depth int) byte {
	var frame [480]byte
	frame[depth%len(frame)] = byte(depth)
	if depth == 0 {
		return frame[0]
	}
	return deepWork(depth-1) + frame[depth%len(frame)]
}

// A goroutine that first grows its stack with GrowStack does the same deep
// work with fewer, shallower copies of its stack.
func BenchmarkFreshGoroutineStack(b *testing.B) {
	for _, grow := range []bool{false, true} {
		name := "grown-as-needed"
		if grow {
			name = "GrowStack-first"
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			done := make(chan byte)
			for b.Loop() {
				go func() {
					if grow {
						GrowStack()
					}
					done <- deepWork(24)
				}()
				<-done
			}
		})
	}
}
