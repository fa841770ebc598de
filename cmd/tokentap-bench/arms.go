// The arms of the side-by-side bench: the paths from the load generator to
// the simulated backend (direct, tokentap, a bare Go relay, nginx, HAProxy),
// each started as a process of its own, and one measured round on an arm.

package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// arm is one path from the load generator to the simulated backend.
type arm struct {
	Name string
	URL  string
	cmd  *exec.Cmd
	pids func() []int // processes whose CPU and memory count (none: direct)
	// Headers are sent with every request through the arm (a gateway's
	// routing headers).
	Headers map[string]string
	// Admin is tokentap's admin address (host:port; "": not tokentap).
	Admin string
}

// measure runs one plan against one arm and reads the arm's CPU time.
func measure(a *arm, p plan) (roundStat, []result) {
	cpu0 := cpuSeconds(a)
	res, wall, _ := run(p)
	cpu := cpuSeconds(a) - cpu0
	var ttft, delay, e2e []time.Duration
	st := roundStat{Seconds: wall.Seconds(), CPU: cpu}
	for i := range res {
		r := &res[i]
		if r.Err != "" || r.Status >= 400 {
			st.Errors++
			continue
		}
		st.Requests++
		st.Tokens += len(r.Tokens)
		if r.TTFT >= 0 {
			ttft = append(ttft, r.TTFT)
		}
		e2e = append(e2e, r.E2E)
		delay = append(delay, r.Delays...)
	}
	d, t, e := newDist(delay), newDist(ttft), newDist(e2e)
	st.TTFTp50, st.TTFTp99, st.DelayP50, st.DelayP99, st.E2Ep50, st.E2Ep99 = t.P50, t.P99, d.P50, d.P99, e.P50, e.P99
	st.ReqPerSec = float64(st.Requests) / max(wall.Seconds(), 1e-9)
	return st, res
}

// startTokentap runs the tokentap binary in dir as the arm name, with its
// access log (written anew) at accessLog, or none when accessLog is "".
func startTokentap(outDir, name, dir string, gomaxprocs int, upstream, accessLog string) (*arm, error) {
	addr, admin := freePort(), freePort()
	args := []string{"-upstream", upstream, "-listen", addr, "-admin", admin}
	if accessLog != "" {
		os.Remove(accessLog)
		args = append(args, "-access-log", accessLog)
	}
	cmd, err := startProc(outDir, name, filepath.Join(dir, "tokentap"), []string{fmt.Sprintf("GOMAXPROCS=%d", gomaxprocs)}, args...)
	if err != nil {
		return nil, err
	}
	return &arm{Name: name, URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: pidsOf(cmd)}, nil
}

// startGoRelay runs one of this program's relay subcommands ("relay",
// "fasthttp-relay") as the arm name at tokentap's GOMAXPROCS.
func startGoRelay(dir, name, sub string, gomaxprocs int, upstream string) (*arm, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	addr := freePort()
	cmd, err := startProc(dir, name, self, []string{fmt.Sprintf("GOMAXPROCS=%d", gomaxprocs)}, sub, "-listen", addr, "-upstream", upstream)
	if err != nil {
		return nil, err
	}
	return &arm{Name: name, URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: pidsOf(cmd)}, nil
}

// startNginx starts nginx in front of upstream; with h2, its clients
// speak HTTP/2 with prior knowledge (listen … http2).
func startNginx(dir, bin, upstream string, workers int, h2 bool) (*arm, error) {
	addr := freePort()
	name, listen, scheme := "nginx", freePortListen(addr, false), "http://"
	if h2 {
		name, listen, scheme = "nginx-h2", freePortListen(addr, true), "h2c://"
	}
	ndir, _ := filepath.Abs(filepath.Join(dir, name))
	os.MkdirAll(filepath.Join(ndir, "logs"), 0o755)
	conf := fmt.Sprintf(`worker_processes %[4]d;
worker_rlimit_nofile 20000;
pid %[1]s/nginx.pid;
error_log %[1]s/logs/error.log warn;
events { worker_connections 20000; }
http {
  access_log off;
  upstream backend { server %[2]s; keepalive 1024; keepalive_requests 1000000; }
  server {
    listen %[3]s;
    keepalive_requests 1000000;
    http2_max_concurrent_streams 128;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
`, ndir, upstream, listen, workers)
	cfg := filepath.Join(ndir, "nginx.conf")
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startProc(dir, name, bin, nil, "-p", ndir, "-c", cfg, "-g", "daemon off;")
	if err != nil {
		return nil, err
	}
	return &arm{Name: name, URL: scheme + addr + "/v1/chat/completions", cmd: cmd, pids: withChildren(cmd)}, nil
}

// freePortListen is nginx's listen directive for addr (h2: HTTP/2 with
// prior knowledge, the parameter nginx 1.22 knows; "http2 on" is 1.25's).
func freePortListen(addr string, h2 bool) string {
	if h2 {
		return addr + " http2"
	}
	return addr
}

func startHAProxy(dir, bin, upstream string, threads int) (*arm, error) {
	addr := freePort()
	conf := fmt.Sprintf(`global
  nbthread %d
  maxconn 9900
defaults
  mode http
  timeout connect 5s
  timeout client 600s
  timeout server 600s
  option http-no-delay
  http-reuse always
frontend fe
  bind %s
  default_backend be
backend be
  server s1 %s maxconn 9900
`, threads, addr, upstream)
	cfg, _ := filepath.Abs(filepath.Join(dir, "haproxy.cfg"))
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	cmd, err := startProc(dir, "haproxy", bin, nil, "-f", cfg, "-db")
	if err != nil {
		return nil, err
	}
	return &arm{Name: "haproxy", URL: "http://" + addr + "/v1/chat/completions", cmd: cmd, pids: withChildren(cmd)}, nil
}

func startProc(dir, name, bin string, env []string, args ...string) (*exec.Cmd, error) {
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return cmd, nil
}

func stop(cmd *exec.Cmd) {
	if cmd == nil || cmd.Process == nil {
		return
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
}

func waitReady(url string) error {
	_, rest, _ := strings.Cut(url, "://")
	addr, _, _ := strings.Cut(rest, "/")
	for i := 0; i < 200; i++ {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(25 * time.Millisecond)
	}
	return fmt.Errorf("%s did not start listening", addr)
}

func freePort() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
