// What the bench reads of the processes it measures: CPU time from
// schedstat, resident memory, the machine it runs on, idle memory per
// stream.

package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
	"time"
)

func raiseFileLimit() {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) == nil {
		l.Cur = l.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l)
	}
}

// fileLimit returns this process's descriptor limit.
func fileLimit() int {
	var l syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l) != nil {
		return 1024
	}
	return int(min(l.Cur, 1<<30))
}

func pidsOf(cmd *exec.Cmd) func() []int {
	return func() []int { return []int{cmd.Process.Pid} }
}

// withChildren counts a master process and its workers.
func withChildren(cmd *exec.Cmd) func() []int {
	return func() []int {
		pids := []int{cmd.Process.Pid}
		entries, _ := os.ReadDir("/proc")
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			if f := procStat(pid); len(f) > 3 && f[3] == strconv.Itoa(cmd.Process.Pid) {
				pids = append(pids, pid)
			}
		}
		return pids
	}
}

// procStat returns the fields of /proc/pid/stat, the command name removed.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return append([]string{"", ""}, strings.Fields(string(b[i+1:]))...)
}

// cpuSeconds returns the CPU time the arm's processes have used: the sum
// over their threads of /proc/<pid>/task/<tid>/schedstat (nanoseconds; a
// burst of a hundred small requests is a few ms of CPU, below the 10 ms
// tick of /proc/<pid>/stat, which is the fallback). A kernel whose
// scheduler statistics are off reads "0 0 0" there; the ticks count then.
func cpuSeconds(a *arm) float64 {
	if a.pids == nil {
		return 0
	}
	var ns, ticks float64
	exact := true
	for _, pid := range a.pids() {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
		if len(tasks) == 0 {
			exact = false
		}
		for _, t := range tasks {
			b, err := os.ReadFile(t)
			f := strings.Fields(string(b))
			if err != nil || len(f) == 0 {
				exact = false
				continue
			}
			v, _ := strconv.ParseFloat(f[0], 64)
			ns += v
		}
		if f := procStat(pid); len(f) > 14 {
			u, _ := strconv.ParseFloat(f[13], 64)
			s, _ := strconv.ParseFloat(f[14], 64)
			ticks += u + s
		}
	}
	if exact && ns > 0 {
		return ns / 1e9
	}
	return ticks / 100 // USER_HZ
}

func rssKB(a *arm) int64 {
	var total int64
	for _, pid := range a.pids() {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "VmRSS:") {
				f := strings.Fields(line)
				if len(f) > 1 {
					n, _ := strconv.ParseInt(f[1], 10, 64)
					total += n
				}
			}
		}
	}
	return total
}

func machine() map[string]string {
	m := map[string]string{"cores": strconv.Itoa(runtime.NumCPU()), "go": runtime.Version()}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "model name") {
				_, v, _ := strings.Cut(line, ":")
				m["cpu"] = strings.TrimSpace(v)
				break
			}
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m["kernel"] = "Linux " + strings.TrimSpace(string(b))
	}
	return m
}

// idleRSS opens n idle streams through a, each a POST of body that
// stays silent after its first event, and returns the growth of its
// resident memory per 1000 streams, in MB.
func idleRSS(a *arm, n int, body string) (float64, error) {
	runtime.GC()
	time.Sleep(300 * time.Millisecond)
	base := rssKB(a)
	host := strings.TrimPrefix(a.URL, "http://")
	addr, path, _ := strings.Cut(host, "/")
	var extra strings.Builder
	for k, v := range a.Headers {
		fmt.Fprintf(&extra, "%s: %s\r\n", k, v)
	}
	req := fmt.Sprintf("POST /%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s", path, addr, len(body), extra.String(), body)
	conns := make([]net.Conn, n)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var firstErr error
	sem := make(chan struct{}, 200)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c, err := net.DialTimeout("tcp", addr, 10*time.Second)
			if err == nil {
				c.SetDeadline(time.Now().Add(30 * time.Second))
				_, err = io.WriteString(c, req)
				br := bufio.NewReader(c)
				for err == nil { // until the first token: the stream is open
					var line []byte
					line, err = br.ReadSlice('\n')
					if bytes.HasPrefix(line, []byte("data:")) {
						break
					}
				}
				c.SetDeadline(time.Time{})
			}
			mu.Lock()
			conns[i] = c
			if err != nil && firstErr == nil {
				firstErr = err
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	time.Sleep(500 * time.Millisecond)
	with := rssKB(a)
	for _, c := range conns {
		if c != nil {
			c.Close()
		}
	}
	time.Sleep(time.Second)
	if firstErr != nil {
		return 0, firstErr
	}
	return float64(with-base) / 1024 / float64(n) * 1000, nil
}

// pinTasks sets the CPUs every thread of each process of pids may run on
// (a thread started later inherits its creator's).
func pinTasks(pids []int, cpus []int) error {
	var set unix.CPUSet
	for _, c := range cpus {
		set.Set(c)
	}
	for _, pid := range pids {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return err
		}
		for _, t := range tasks {
			tid, err := strconv.Atoi(t.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &set); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("pid %d, thread %d: %w", pid, tid, err)
			}
		}
	}
	return nil
}
