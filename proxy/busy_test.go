package proxy

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/mockllm"
	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// envMockChild makes this test binary the simulated server of the busy
// machine's test, in a process of its own: the CPU the test takes from
// tokentap it does not take from the server.
const envMockChild = "TOKENTAP_TEST_MOCK_CHILD"

// serveMockChild, in the child, serves overloadBackend on a loopback port,
// says its address on stdout, and serves until its stdin closes (the
// parent ended).
func serveMockChild() {
	if os.Getenv(envMockChild) == "" {
		return
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		os.Exit(2)
	}
	fmt.Println(ln.Addr().String())
	go func() {
		_, _ = bufio.NewReader(os.Stdin).ReadString('\n')
		os.Exit(0)
	}()
	_ = http.Serve(ln, mockllm.New(overloadBackend))
	os.Exit(0)
}

// startMockChild starts the simulated server in a child process and
// returns its URL.
func startMockChild(t *testing.T) string {
	t.Helper()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), envMockChild+"=1")
	stdin, err := child.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = child.Wait()
	})
	addr, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("the simulated server's process said no address: %v", err)
	}
	return "http://" + strings.TrimSpace(addr)
}

// spin keeps n goroutines busy until stop closes: a machine whose CPU
// tokentap waits for.
func spin(n int, stop chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for x := 0; ; x++ {
				if x%50_000 == 0 {
					select {
					case <-stop:
						return
					default:
					}
				}
			}
		})
	}
	return &wg
}

// TestNoFalseShedsOnABusyMachine: tokentap, with 8 goroutines of its
// process spinning beside it, in front of the simulated server of 8 slots
// (about 28 requests a second) in a process of its own, offered 0.6 of its
// capacity, a fifth of it critical: next to nothing is shed (at most 2%),
// and as many requests are good as a twin without shedding got in the
// same seconds in front of a server of its own (less 2% of those sent),
// and at least 90%. The upstream's model learns each first token from
// when the request was sent to when the kernel received the token's
// bytes: the time tokentap waits for a processor is not the backend's;
// and a busy machine hears of first tokens late, which the gate does not
// read as a queue (proxy/admission/shed: TestNoShedBelowCapacityWhenHeardLate).
func TestNoFalseShedsOnABusyMachine(t *testing.T) {
	wait.Long(t, "11 s of load beside 8 spinning goroutines")
	const capacity = 28.0
	var tps [2]*testProxy
	for i, shed := range []bool{false, true} {
		up := startMockChild(t)
		tps[i] = startProxyRecords(t, up, func(c *Config) {
			c.SLO = overloadSLO
			c.Routes[0].Overload = &Overload{Shed: shed, PriorityHeader: "X-Priority", TrustPriorityHeader: true}
		}, Options{}, 10000)
	}
	stop := make(chan struct{})
	spinners := spin(8, stop)
	defer func() {
		close(stop)
		spinners.Wait()
	}()
	var off, on *tally
	var wg sync.WaitGroup
	wg.Go(func() { off, _ = run(t, tps[0], 0.6*capacity, 3*time.Second, 8*time.Second, 0.2, 13) })
	wg.Go(func() { on, _ = run(t, tps[1], 0.6*capacity, 3*time.Second, 8*time.Second, 0.2, 13) })
	wg.Wait()
	t.Logf("not shedding: %d sent, %d good, %d failed; critical %d of %d good", off.sent, off.good, off.failed, off.critGood, off.critSent)
	t.Logf("shedding: %d sent, %d good, %d shed, %d failed; critical %d of %d good", on.sent, on.good, on.shed, on.failed, on.critGood, on.critSent)
	sent := float64(on.sent)
	if float64(on.shed) > 0.02*sent || float64(on.good) < min(0.9*sent, float64(off.good)-0.02*sent) {
		t.Errorf("at 0.6x on a busy machine: %d of %d shed, %d good (%d without shedding)", on.shed, on.sent, on.good, off.good)
	}
}
