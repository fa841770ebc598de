package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
	"github.com/tokentap/tokentap/ratelimit/redistest"
)

// TestMain lets the test binary be tokentap itself (TOKENTAP_TEST_MAIN=1):
// the replicas of TestReplicasShareLimits are processes of their own,
// which a test can kill.
func TestMain(m *testing.M) {
	if os.Getenv("TOKENTAP_TEST_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// replica is a tokentap process of the test binary.
type replica struct {
	cmd           *exec.Cmd
	listen, admin string
}

func startReplica(t *testing.T, cfg string) *replica {
	t.Helper()
	r := &replica{listen: freeAddr(t), admin: freeAddr(t)}
	r.cmd = exec.Command(os.Args[0], "-config", cfg, "-listen", r.listen, "-admin", r.admin, "-access-log", "")
	r.cmd.Env = append(os.Environ(), "TOKENTAP_TEST_MAIN=1")
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if r.cmd.ProcessState == nil {
			_ = r.cmd.Process.Signal(syscall.SIGTERM)
			_ = r.cmd.Wait()
		}
	})
	waitUp(t, "http://"+r.admin+"/healthz")
	return r
}

// send posts one chat as the tenant of key through r and returns the
// status and the body it read.
func (r *replica) send(t *testing.T, key string, maxTokens int) (int, string) {
	req, _ := http.NewRequest("POST", "http://"+r.listen+"/v1/chat/completions",
		strings.NewReader(fmt.Sprintf(`{"model":"m","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"hi"}]}`, maxTokens)))
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Three tokentap processes on one Redis hold each tenant's limits
// together: a tenant sending five times its rate through all three gets
// its rate in total; a replica killed (SIGKILL) in the middle of a stream
// holds the tenant's one concurrency slot no longer than the lease time;
// with Redis stopped, fail closed answers 503 with a clear error, and the
// shared limits decide again once Redis is back.
func TestReplicasShareLimits(t *testing.T) {
	wait.Long(t, "three tokentap processes on one Redis")
	redis := redistest.Start(t)
	backend := startMockllm(t, mockllm.Options{PrefillBase: time.Millisecond, TokenGap: 5 * time.Millisecond})
	cfg := writeFile(t, fmt.Sprintf(`upstream: %s
tenants:
  - name: alpha
    keys: [key-alpha-0123456789]
    requests_per_second: 5
    burst: 2
  - name: beta
    keys: [key-beta-01234567890]
    max_concurrent: 1
  - name: gamma
    keys: [key-gamma-0123456789]
    tokens_per_minute: 3000
admission:
  store:
    redis: {addr: %q, timeout: 200ms, key_prefix: "replicas%d:"}
    fail: closed
    lease_ttl: 2s
`, backend, redis.Addr, time.Now().UnixNano()))
	reps := []*replica{startReplica(t, cfg), startReplica(t, cfg), startReplica(t, cfg)}

	// Rate: 25 a second through the three, for 3 s: five times the rate.
	start := time.Now()
	admitted, refused := 0, 0
	for i := 0; time.Since(start) < 3*time.Second; i++ {
		switch code, _ := reps[i%3].send(t, "key-alpha-0123456789", 1); code {
		case 200:
			admitted++
		case 429:
			refused++
		default:
			t.Fatalf("status %d", code)
		}
		time.Sleep(40 * time.Millisecond)
	}
	elapsed := time.Since(start).Seconds()
	if want := 2 + 5*elapsed; float64(admitted) > want+2 || float64(admitted) < want-4 {
		t.Errorf("alpha: %d admitted, %d refused in %.1f s through three replicas; its limit gives %.0f in total (±2)", admitted, refused, elapsed, want)
	}
	t.Logf("rate: %d admitted, %d refused in %.1f s through three replicas (5/s, burst 2: %.0f)", admitted, refused, elapsed, 2+5*elapsed)

	// A stream holds beta's one slot on replica 2; replica 2 is killed.
	streaming := make(chan struct{})
	go func() {
		req, _ := http.NewRequest("POST", "http://"+reps[2].listen+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"max_tokens":4000,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer key-beta-01234567890")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			close(streaming)
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	<-streaming
	if code, body := reps[0].send(t, "key-beta-01234567890", 1); code != 429 || !strings.Contains(body, "concurrency") {
		t.Fatalf("beta's second request while its stream runs elsewhere: %d %s", code, body)
	}
	time.Sleep(2 * time.Second) // the stream's lease is renewed meanwhile: still held
	if code, _ := reps[1].send(t, "key-beta-01234567890", 1); code != 429 {
		t.Fatalf("beta's slot was freed while its stream still ran (status %d): the lease was not renewed", code)
	}
	_ = reps[2].cmd.Process.Kill()
	_ = reps[2].cmd.Wait()
	killed := time.Now()
	for ; ; time.Sleep(100 * time.Millisecond) {
		code, _ := reps[0].send(t, "key-beta-01234567890", 1)
		if code == 200 {
			break
		}
		if time.Since(killed) > 10*time.Second {
			t.Fatalf("beta's slot still held %v after its replica was killed (lease 2 s)", time.Since(killed))
		}
	}
	freed := time.Since(killed)
	if freed > 3500*time.Millisecond {
		t.Errorf("the killed replica's slot was freed after %v: the lease is 2 s", freed)
	}
	t.Logf("lease: the killed replica's slot was free again after %v (lease 2 s)", freed.Round(10*time.Millisecond))

	// A token budget across the two live replicas: two streams reserving
	// about 1,020 tokens each (1,000 of output declared) fit in gamma's
	// 3,000, a third does not; a client that leaves its stream early gives
	// back what it did not use, and a request fits again on the other.
	stream := func(r *replica) (*http.Response, error) {
		req, _ := http.NewRequest("POST", "http://"+r.listen+"/v1/chat/completions",
			strings.NewReader(`{"model":"m","stream":true,"max_tokens":1000,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("Authorization", "Bearer key-gamma-0123456789")
		return http.DefaultClient.Do(req)
	}
	s0, err := stream(reps[0])
	if err != nil || s0.StatusCode != 200 {
		t.Fatalf("gamma's first stream: %v %v", s0, err)
	}
	s1, err := stream(reps[1])
	if err != nil || s1.StatusCode != 200 {
		t.Fatalf("gamma's second stream: %v %v", s1, err)
	}
	defer s1.Body.Close()
	if code, body := reps[0].send(t, "key-gamma-0123456789", 1000); code != 429 || !strings.Contains(body, "tokens") {
		t.Fatalf("gamma's third reservation: %d %s", code, body)
	}
	_, _ = io.ReadFull(s0.Body, make([]byte, 200)) // a few tokens, then the client leaves
	s0.Body.Close()
	refunded := time.Now()
	for {
		s2, err := stream(reps[1])
		if err != nil {
			t.Fatal(err)
		}
		s2.Body.Close()
		if s2.StatusCode == 200 {
			break
		}
		if time.Since(refunded) > 10*time.Second {
			t.Fatal("the cancelled stream's unused reservation was not given back")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("tokens: 2 of 3 reservations of about 1,020 on a 3,000 budget across replicas; the cancelled stream's refund admitted the third %v after its client left", time.Since(refunded).Round(time.Millisecond))

	// Redis stopped: fail closed answers 503; back: admitted again.
	redis.Stop()
	code, body := reps[0].send(t, "key-beta-01234567890", 1)
	if code != 503 || !strings.Contains(body, "admission_store_unavailable") {
		t.Fatalf("with Redis stopped, fail closed: %d %s", code, body)
	}
	redis.Restart()
	back := time.Now()
	for {
		if code, _ := reps[1].send(t, "key-beta-01234567890", 1); code == 200 {
			break
		}
		if time.Since(back) > 10*time.Second {
			t.Fatal("Redis back for 10 s, still not admitted")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("Redis stopped: 503 at once; back: admitted again after %v", time.Since(back).Round(time.Millisecond))
	var metricsText string
	_, metricsText = get(t, "http://"+reps[0].admin+"/metrics")
	if !strings.Contains(metricsText, "tokentap_admission_store_up 1") || !strings.Contains(metricsText, "tokentap_admission_store_call_seconds") {
		t.Errorf("/metrics lacks the store's gauges")
	}
}

// TestStoreOutageUnderLoad: three tokentap processes on one Redis under
// steady load through all three; Redis is killed a second in and started
// again a second later. fail: closed answers 503 while it is down and
// nothing else fails; fail: open keeps admitting each replica's share of
// the limit. Both recover once Redis is back. The counts are printed.
func TestStoreOutageUnderLoad(t *testing.T) {
	wait.Long(t, "Redis stopped under load, twice")
	backend := startMockllm(t, mockllm.Options{PrefillBase: time.Millisecond, TokenGap: time.Millisecond})
	for _, mode := range []string{"closed", "open"} {
		t.Run(mode, func(t *testing.T) {
			redis := redistest.Start(t)
			cfg := writeFile(t, fmt.Sprintf(`upstream: %s
tenants:
  - name: alpha
    keys: [key-alpha-0123456789]
    requests_per_second: 60
    burst: 20
admission:
  store:
    redis: {addr: %q, timeout: 100ms, key_prefix: "outage%d:"}
    fail: %s
`, backend, redis.Addr, time.Now().UnixNano(), mode))
			reps := []*replica{startReplica(t, cfg), startReplica(t, cfg), startReplica(t, cfg)}
			type counts struct{ ok, limited, unavailable, other int }
			var mu sync.Mutex
			phase := 0 // 0 before, 1 Redis down, 2 back
			var byPhase [3]counts
			var firstBack time.Duration
			var backAt time.Time
			stop := make(chan struct{})
			var wg sync.WaitGroup
			for w := range 6 {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						default:
						}
						code, _ := reps[w%3].send(t, "key-alpha-0123456789", 1)
						mu.Lock()
						c := &byPhase[phase]
						switch code {
						case 200:
							c.ok++
							if phase == 2 && firstBack == 0 {
								firstBack = time.Since(backAt)
							}
						case 429:
							c.limited++
						case 503:
							c.unavailable++
						default:
							c.other++
						}
						mu.Unlock()
					}
				})
			}
			time.Sleep(time.Second)
			mu.Lock()
			phase = 1
			mu.Unlock()
			redis.Stop()
			time.Sleep(time.Second)
			redis.Restart()
			mu.Lock()
			phase, backAt = 2, time.Now()
			mu.Unlock()
			time.Sleep(time.Second)
			close(stop)
			wg.Wait()
			t.Logf("fail %s: before %+v; Redis down 1 s %+v; back %+v; first admitted %v after Redis was back",
				mode, byPhase[0], byPhase[1], byPhase[2], firstBack.Round(time.Millisecond))
			for i, c := range byPhase {
				if c.other != 0 {
					t.Errorf("phase %d: %d answers other than 200, 429 and 503", i, c.other)
				}
			}
			if byPhase[0].ok == 0 || byPhase[0].unavailable != 0 || byPhase[2].ok == 0 || firstBack > 2*time.Second {
				t.Errorf("before or after the outage: %+v, %+v (first admitted %v after)", byPhase[0], byPhase[2], firstBack)
			}
			switch mode {
			case "closed":
				if byPhase[1].unavailable == 0 {
					t.Errorf("fail closed: no 503 while Redis was down: %+v", byPhase[1])
				}
			case "open":
				// Each replica its share: 60/s and a burst of 20 in all.
				if d := byPhase[1]; d.unavailable != 0 || d.ok == 0 || d.ok > 2*(60+20) {
					t.Errorf("fail open: while Redis was down %+v, want about 60 admitted a second in all and no 503", d)
				}
			}
		})
	}
}
