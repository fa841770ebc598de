package routing

import (
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/upstream"
)

func TestParseBackendMetrics(t *testing.T) {
	cases := []struct {
		name, text           string
		running, waiting, kv float64
	}{
		{"vllm", `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 5.0
vllm:num_requests_running{engine="1",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.61
vllm:num_requests_waiting_by_reason{reason="capacity"} 99
`, 8, 7, 0.61},
		{"llama.cpp", "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n", 2, 1, -1},
		{"sglang", "sglang:num_running_reqs{model_name=\"q\"} 4\nsglang:num_queue_reqs{model_name=\"q\"} 0\nsglang:token_usage{model_name=\"q\"} 0.2\n", 4, 0, 0.2},
		{"garbage", "vllm:num_requests_running{ 3\nvllm:num_requests_waiting NaN\nvllm:num_requests_waiting -4\n\x00\xff\nother 1\n", -1, -1, -1},
		{"label with braces", `vllm:num_requests_running{model_name="a}b"} 2 1700000000000` + "\n", 2, -1, -1},
	}
	for _, c := range cases {
		st := &BackendState{Running: -1, Waiting: -1, KV: -1}
		parseBackendMetrics([]byte(c.text), st)
		if st.Running != c.running || st.Waiting != c.waiting || st.KV != c.kv {
			t.Errorf("%s: running %v waiting %v kv %v, want %v %v %v", c.name, st.Running, st.Waiting, st.KV, c.running, c.waiting, c.kv)
		}
	}
}

func FuzzParseBackendMetrics(f *testing.F) {
	f.Add([]byte("vllm:num_requests_running{a=\"b\"} 3\n"))
	f.Add([]byte("# x\nllamacpp:requests_deferred 1e3 12\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st := &BackendState{Running: -1, Waiting: -1, KV: -1}
		parseBackendMetrics(b, st)
		if st.KV > 1 || st.Running < -1 || st.Waiting < -1 {
			t.Fatalf("out of range: %+v", st)
		}
	})
}

// TestPredictionWeighsBackendQueue: two upstreams whose models learned the
// same 30 ms first token at every level tokentap saw; the first's server
// reports 2 running and 4 waiting (another client's), its requests held
// it 80 ms each. Its prediction is at least its turn in that queue, 30 +
// (4+1) x 80 / 2 = 230 ms, and least_ttft sends the request elsewhere but
// for a probe; without a fresh scrape the two are alike and the first (a
// tie to the first) is chosen.
func TestPredictionWeighsBackendQueue(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	var members []*Member
	for _, name := range []string{"a", "b"} {
		up, err := upstream.New("http://127.0.0.1:1", upstream.DefaultTimeouts, clock, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := range 40 {
			up.Gate.Model.Observe(i%3, 100, 30*time.Millisecond, 5*time.Millisecond, -1)
		}
		members = append(members, &Member{Name: name, Up: up, Weight: 1})
	}
	a := members[0]
	a.Scrape = NewScraper("http://127.0.0.1:1/metrics", clock)
	a.NoteSlot(80 * time.Millisecond)
	r := NewSet(members, Options{Balance: BalanceLeastTTFT}, now)

	a.Scrape.state.Store(&BackendState{Running: 2, Waiting: 4, KV: -1, At: now})
	ta, _ := a.PredictTTFT(now, 0, 100)
	if ta < 229*time.Millisecond || ta > 231*time.Millisecond {
		t.Errorf("prediction with a queue of 4 ahead: %v, want 230ms", ta)
	}
	if m, _, why := r.leastTTFT(now, 100, 0.5, 0); m != members[1] || why != pickLeastTTFT {
		t.Errorf("with a's queue: chose %s (%s), want b", m.Name, reasonNames[why])
	}
	if m, _, why := r.leastTTFT(now, 100, 0.001, 0); m != a || why != pickProbe {
		t.Errorf("a probe's roll: chose %s (%s), want a as a probe", m.Name, reasonNames[why])
	}
	// The scrape grows stale: nothing said, the two alike.
	now = now.Add(scrapeFresh + time.Second)
	if tb, _ := a.PredictTTFT(now, 0, 100); tb > 40*time.Millisecond {
		t.Errorf("a stale scrape still weighs: %v", tb)
	}
	if m, _, _ := r.leastTTFT(now, 100, 0.5, 0); m != a {
		t.Errorf("without a fresh scrape: chose %s, want the tie's first, a", m.Name)
	}
}
