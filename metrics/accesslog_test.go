package metrics

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap/zapcore"
)

// syncBuffer is a goroutine-safe log destination; gate, when set, holds
// every write until it is closed.
type syncBuffer struct {
	mu   sync.Mutex
	b    bytes.Buffer
	gate chan struct{}
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	if s.gate != nil {
		<-s.gate
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) Sync() error { return nil }

func (s *syncBuffer) lines(t *testing.T) []map[string]any {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(s.b.Bytes()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %q: %v", sc.Bytes(), err)
		}
		out = append(out, m)
	}
	return out
}

func testRecord(i int) *Record {
	var r Record
	r.Reset()
	r.RequestID = fmt.Sprint("r", i)
	r.Status = 200
	r.Outcome = OutcomeOK
	r.TTFT = time.Duration(i) * time.Millisecond
	return &r
}

// Records come out one JSON line each, in order, none lost; a lone record
// is written at once, without waiting for a batch or a Flush; while records
// keep coming they are written every batchEvery; Close writes the rest. On
// synctest's fake clock, so every timing is exact.
func TestAccessLogLines(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var buf syncBuffer
		a := NewAccessLog(&buf, 0)
		a.Observe(testRecord(0))
		synctest.Wait() // the writer is idle again
		if n := len(buf.lines(t)); n != 1 {
			t.Fatalf("a lone record: %d lines, want 1 at once", n)
		}
		// A burst: the first batch goes out batchEvery after the lone line.
		for i := 1; i < 2500; i++ {
			a.Observe(testRecord(i))
		}
		synctest.Wait()
		if n := len(buf.lines(t)); n != 1 {
			t.Fatalf("%d lines before the batch was due, want 1", n)
		}
		time.Sleep(batchEvery)
		synctest.Wait()
		if n := len(buf.lines(t)); n != 2500 {
			t.Fatalf("%d lines after one batch period, want 2500", n)
		}
		for i := 2500; i < 5000; i++ {
			a.Observe(testRecord(i))
			if i == 2500 {
				a.Flush()
				if n := len(buf.lines(t)); n != 2501 {
					t.Fatalf("after Flush: %d lines, want 2501", n)
				}
			}
		}
		a.Close()
		lines := buf.lines(t)
		if len(lines) != 5000 {
			t.Fatalf("%d lines, want 5000", len(lines))
		}
		for i, m := range lines {
			if m["request_id"] != fmt.Sprint("r", i) || m["ttft_ms"] != float64(i) || m["outcome"] != "ok" {
				t.Fatalf("line %d: %v", i, m)
			}
		}
	})
}

// A writer that stalls never blocks Observe: records beyond the queue are
// dropped and counted.
func TestAccessLogNeverBlocks(t *testing.T) {
	buf := syncBuffer{gate: make(chan struct{})}
	a := NewAccessLog(zapcore.AddSync(&buf), 16)
	before := accessLogDropped.Get()
	done := make(chan struct{})
	go func() {
		for i := range 1000 {
			a.Observe(testRecord(i))
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second): // the writer stays stalled: a blocked Observe never returns
		t.Fatal("Observe blocked behind a stalled writer")
	}
	dropped := accessLogDropped.Get() - before
	close(buf.gate)
	a.Close()
	written := uint64(len(buf.lines(t)))
	if dropped == 0 || written+dropped != 1000 {
		t.Fatalf("written %d + dropped %d, want 1000 with some dropped", written, dropped)
	}
}
