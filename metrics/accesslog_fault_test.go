package metrics

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/synctest"
	"time"
)

// fullDisk is an output that fails like a full disk while full is set: it
// takes part of a write (as a file system does when it fills mid-write)
// and returns ENOSPC.
type fullDisk struct {
	mu     sync.Mutex
	b      bytes.Buffer
	full   bool
	failed int
}

func (d *fullDisk) Write(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.full {
		d.failed++
		n := len(p) / 3
		d.b.Write(p[:n])
		return n, syscall.ENOSPC
	}
	return d.b.Write(p)
}

func (d *fullDisk) Sync() error { return nil }

func (d *fullDisk) set(full bool) {
	d.mu.Lock()
	d.full = full
	d.mu.Unlock()
}

func (d *fullDisk) lines() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return strings.Split(strings.TrimSuffix(d.b.String(), "\n"), "\n")
}

// A disk that fills up loses no line: writes fail, are counted and retried
// from where they stopped, and once space is free every line is written,
// whole and in order, without a restart.
func TestAccessLogSurvivesFullDisk(t *testing.T) {
	synctest.Test(t, testAccessLogSurvivesFullDisk) // the retry backoff on a fake clock
}

func testAccessLogSurvivesFullDisk(t *testing.T) {
	d := &fullDisk{}
	a := NewAccessLog(d, 0)
	defer a.Close()
	errsBefore, dropBefore := accessLogWriteErrors.Get(), accessLogDropped.Get()
	for i := 0; i < 100; i++ {
		a.Observe(testRecord(i))
	}
	a.Flush()
	d.set(true)
	for i := 100; i < 600; i++ {
		a.Observe(testRecord(i))
	}
	a.Flush()
	time.Sleep(200 * time.Millisecond) // a few retries while full
	d.set(false)
	deadline := time.Now().Add(10 * time.Second)
	for len(d.lines()) < 600 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	lines := d.lines()
	if len(lines) != 600 {
		t.Fatalf("%d lines after the disk was freed, want 600", len(lines))
	}
	for i, l := range lines {
		if !strings.Contains(l, `"request_id":"r`+itoa(i)+`"`) || !strings.HasSuffix(l, "}") {
			t.Fatalf("line %d is not record %d, whole: %q", i, i, l)
		}
	}
	if got := accessLogWriteErrors.Get() - errsBefore; got == 0 {
		t.Error("write errors were not counted")
	}
	if got := accessLogDropped.Get() - dropBefore; got != 0 {
		t.Errorf("%d lines counted as dropped, want 0", got)
	}
	// Writing works again at once.
	a.Observe(testRecord(600))
	a.Flush()
	if n := len(d.lines()); n != 601 {
		t.Fatalf("%d lines, want 601", n)
	}
}

// A record observed after Close is counted as dropped, never a panic (a
// stream can outlive the drain).
func TestAccessLogObserveAfterClose(t *testing.T) {
	var buf syncBuffer
	a := NewAccessLog(&buf, 0)
	a.Observe(testRecord(1))
	a.Close()
	before := accessLogDropped.Get()
	a.Observe(testRecord(2))
	a.Flush()
	if err := a.Reopen(); err == nil {
		t.Error("Reopen after Close succeeded")
	}
	a.Close()
	if got := accessLogDropped.Get() - before; got != 1 {
		t.Fatalf("dropped grew by %d, want 1", got)
	}
	if n := len(buf.lines(t)); n != 1 {
		t.Fatalf("%d lines, want 1", n)
	}
}

// After a logrotate-style rename, Reopen sends new lines to a new file at
// the configured path; every line is in one of the two files.
func TestAccessLogReopenAfterRename(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "access.log")
	a, err := OpenAccessLog(path, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for i := 0; i < 300; i++ {
		a.Observe(testRecord(i))
	}
	if err := os.Rename(path, path+".1"); err != nil {
		t.Fatal(err)
	}
	if err := a.Reopen(); err != nil {
		t.Fatal(err)
	}
	for i := 300; i < 500; i++ {
		a.Observe(testRecord(i))
	}
	a.Close()
	count := func(p string) int {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return bytes.Count(b, []byte{'\n'})
	}
	if old, cur := count(path+".1"), count(path); old != 300 || cur != 200 {
		t.Fatalf("rotated file has %d lines, new file %d; want 300 and 200", old, cur)
	}
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}
