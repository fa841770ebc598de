#!/usr/bin/env bash
# What tokentap's CPU per request is made of, against the bare fasthttp proxy
# (tokentap-bench fasthttp-relay) on the same libraries: each proxy alone on
# one core (GOMAXPROCS=1) in front of mockllm (20 ms): non-streamed requests
# closed-loop with 256 in flight (the proxy busy: no idle wake-ups in the
# figure), then open-loop at 1,000/s (the frontier bench's CPU figure), then
# short streams (one token) at 1,000/s, what a stream's start and end cost.
# perf samples each proxy's stacks; every sample is charged to the first duty
# (below) whose function is on its stack, so the duties' shares add up. CPU
# per request comes from perf's task clock. Needs perf (Debian: linux-perf)
# and permission to profile (root, or kernel.perf_event_paranoid <= 1).
# About 5 minutes with 3 rounds; each figure is the median over them. Writes
# the figures to stdout and OUT/report.md, the raw profiles to OUT (default
# /tmp/tokentap-cpu-floor).
#
#   examples/bench/cpu-floor.sh [OUT]        # ROUNDS=N in the environment: rounds (3)
#   BASE=REV examples/bench/cpu-floor.sh     # also tokentap built at git revision REV
#                                            # (tokentap-base), in the same rounds: an A/B
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/tokentap-cpu-floor}
rounds=${ROUNDS:-3}
mkdir -p "$out"
rm -f "$out/access.log"
command -v perf >/dev/null || { echo "perf not installed (apt-get install linux-perf)" >&2; exit 2; }
go build -o "$out/tokentap" ./cmd/tokentap
go build -o "$out/tokentap-bench" ./cmd/tokentap-bench
go build -o "$out/mockllm" ./cmd/mockllm
if [ -n "${BASE:-}" ]; then
  rm -rf "$out/base-src"
  git worktree add -f --detach "$out/base-src" "$BASE" >/dev/null
  (cd "$out/base-src" && go build -o "$out/tokentap-base" ./cmd/tokentap)
  git worktree remove -f "$out/base-src"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock=127.0.0.1:$(free_port)
listen=127.0.0.1:$(free_port)
admin=127.0.0.1:$(free_port)
GOMAXPROCS=1 "$out/mockllm" -listen "$mock" -prefill-per-token 0 -jitter 0.2 >"$out/mockllm.log" 2>&1 &
mockpid=$!
pid=
trap 'kill $mockpid $pid 2>/dev/null || true' EXIT
cat >"$out/tokentap.yaml" <<EOF
listen: "$listen"
admin: "$admin"
upstream: "http://$mock"
relay: loop
access_log: "$out/access.log"
slo: {ttft: 1s, tpot: 100ms, e2e: 30s, target: 99%}
EOF

# Duties, first match wins: NAME|functions (;-separated). A function ending
# in "." names every method of a type; any other must end a frame's name.
duties=(
  "peer watch (its seat in a loop; epoll_ctl on a connection's first request)|proxy.(*peerWatch).start;proxy.(*peerWatch).stop"
  "record: stats sketches, series, SLO, access-log queue|proxy.(*exchange).record"
  "access log writer (zap JSON, write)|metrics.(*AccessLog).run"
  "usage parse of a whole response (gjson)|proxy.(*exchange).accountBody"
  "stream events parse (SSE, dialect)|proxy.(*tap).parse;proxy.(*tap).observe"
  "client side (TCP_INFO, ACK marks, end wait)|proxy.(*clientSide).;proxy.(*lookWatch).;proxy.(*ackMark).;proxy.(*ackWatch)."
  "header rewrite (hop-by-hop, X-Forwarded-*, request id)|proxy.prepareRequest;proxy.copyResponseHeader"
  "request parse and route (gjson, dialect)|proxy.(*exchange).readRequest;proxy.(*exchange).pickRoute"
  "pooled-connection check (MSG_PEEK)|proxy.(*upConn).peek"
  "upstream round trip (write, read header)|proxy.(*upConn).send;fasthttp.(*HostClient).Do"
  "upstream pool and attempt bookkeeping|proxy.(*upstream).get;proxy.(*upstream).put;proxy.(*upstreamAttempt).forward;proxy.(*upstreamAttempt).attempt"
  "response to the client (fasthttp's write, relay loop, chunk pass)|fasthttp.writeResponse;bufio.(*Writer).Flush;proxy.(*bodyRelay).passChunks;proxy.(*bodyRelay).servePass;proxy.(*relayLoop).turn"
  "request read from the client|bufio.(*Reader).Peek;fasthttp.(*RequestHeader).readLoop;fasthttp.(*Request).readBodyStream;fasthttp.(*Request).readLimitBody"
  "rest of the request goroutines|fasthttp.(*Server).serveConnCounted"
  "stream hand-offs (hijack, the loop's take and release, resume)|fasthttp.hijackConnHandler;proxy.(*bodyRelay).relayEnded.gowrap1;proxy.(*bodyRelay).endPass.gowrap1;proxy.(*relayLoop)."
  "Go runtime: sysmon|runtime.sysmon"
  "Go runtime: scheduler and netpoll while idle|runtime.mcall;runtime.findRunnable"
  "Go runtime: garbage collection|runtime.gcBgMarkWorker;runtime.bgsweep;runtime.bgscavenge"
)

profile() { # NAME MOCK-TIMING STREAM LOAD-ARGS... ; the proxy under test is $pid
  local name=$1 timing=$2 stream=$3; shift 3
  "$out/tokentap-bench" -url "http://$listen/_mock/$timing/v1/chat/completions" -model m -workload tiny \
    -stream="$stream" -duration 14s -requests 0 "$@" >"$out/$name.load" 2>&1 &
  local load=$!
  sleep 3
  rm -f "$out/$name.perf" "$out/$name.perf.old"
  perf record -q -F 2000 -g -p "$pid" -o "$out/$name.perf" -- sleep 8 >/dev/null 2>&1
  perf stat -x, -e task-clock -p "$pid" -o "$out/$name.stat" -- sleep 2 >/dev/null 2>&1 || true
  wait "$load"
  local rps ms
  rps=$(grep -o 'throughput [0-9.]*' "$out/$name.load" | awk '{print $2}')
  ms=$(awk -F, '/task-clock/ {print $1}' "$out/$name.stat")
  awk -v ms="$ms" -v rps="$rps" 'BEGIN { printf "%.1f", ms * 1000 / (2 * rps) }' >"$out/$name.us"
  perf script -i "$out/$name.perf" -F ip,sym 2>/dev/null | awk -v spec="$(printf '%s\n' "${duties[@]}")" '
    BEGIN { n = split(spec, lines, "\n"); for (i = 1; i <= n; i++) { split(lines[i], kv, "|"); name[i] = kv[1]; np[i] = split(kv[2], parts, ";"); for (j = 1; j <= np[i]; j++) pre[i, j] = parts[j] } ; nd = n }
    function matches(f, p) {
      if (substr(p, length(p)) == ".") return index(f, p) > 0
      return length(f) >= length(p) && substr(f, length(f) - length(p) + 1) == p
    }
    function flush(   i, j, k, hit) {
      if (ns == 0) return
      tot++; hit = 0
      for (i = 1; i <= nd && !hit; i++)
        for (k = 1; k <= ns && !hit; k++)
          for (j = 1; j <= np[i]; j++)
            if (matches(st[k], pre[i, j])) { c[i]++; hit = 1; break }
      if (!hit) other++
      ns = 0
    }
    /^$/ { flush(); next }
    { sub(/^[ \t]+[0-9a-f]+ /, ""); st[++ns] = $0 }
    END { flush(); for (i = 1; i <= nd; i++) printf "%s\t%.4f\n", name[i], c[i] / tot; printf "other (kernel and runtime elsewhere)\t%.4f\n", other / tot }' >"$out/$name.duties"
}

run_arm() { # ARM ROUND CMD...
  local arm=$1 round=$2; shift 2
  GOMAXPROCS=1 "$@" >"$out/$arm.log" 2>&1 &
  pid=$!
  sleep 1
  profile "$arm-busy-r$round" 20ms/0s false -concurrency 256
  profile "$arm-1000-r$round" 20ms/0s false -rate 1000
  profile "$arm-streams-r$round" 20ms/1ms true -rate 1000
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

# Rounds, the arms' order alternating: this machine's figures move from one
# run to the next, so each figure is the median over the rounds.
for round in $(seq 1 "$rounds"); do
  tokentap_arm() { run_arm tokentap "$round" "$out/tokentap" -config "$out/tokentap.yaml"; }
  base_arm() { [ -z "${BASE:-}" ] || run_arm tokentap-base "$round" "$out/tokentap-base" -config "$out/tokentap.yaml"; }
  relay_arm() { run_arm fasthttp-relay "$round" "$out/tokentap-bench" fasthttp-relay -listen "$listen" -upstream "$mock"; }
  if [ $((round % 2)) = 1 ]; then tokentap_arm; base_arm; relay_arm; else relay_arm; base_arm; tokentap_arm; fi
done

python3 - "$out" "$rounds" "${BASE:-}" <<'PY' | tee "$out/report.md"
import statistics, sys
out, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
titles = {"busy": "Non-streamed requests, 256 in flight (busy)",
          "1000": "Non-streamed requests, 1,000/s, Poisson",
          "streams": "Short streams (one token), 1,000/s, Poisson: what a stream's start and end cost"}
def load(arm, kind):
    cpu, rows = [], {}
    for r in range(1, rounds + 1):
        us = float(open(f"{out}/{arm}-{kind}-r{r}.us").read())
        cpu.append(us)
        for line in open(f"{out}/{arm}-{kind}-r{r}.duties"):
            name, share = line.rstrip("\n").split("\t")
            rows.setdefault(name, []).append(float(share) * us)
    return statistics.median(cpu), cpu, {k: statistics.median(v) for k, v in rows.items()}, list(rows)
for kind, title in titles.items():
    unit = "stream" if kind == "streams" else "request"
    t, tr, trows, names = load("tokentap", kind)
    f, fr, frows, _ = load("fasthttp-relay", kind)
    print(f"\n## {title}\n")
    print(f"CPU per {unit} (median of {rounds} rounds): tokentap {t:.1f} µs [{min(tr):.1f}–{max(tr):.1f}], "
          f"fasthttp-relay {f:.1f} µs [{min(fr):.1f}–{max(fr):.1f}] ({t / f:.2f}×)\n")
    brows = {}
    if base:
        bt, br, brows, _ = load("tokentap-base", kind)
        print(f"tokentap at {base} (tokentap-base): {bt:.1f} µs [{min(br):.1f}–{max(br):.1f}]; "
              f"tokentap ÷ tokentap-base {t / bt:.2f}×, tokentap-base ÷ fasthttp-relay {bt / f:.2f}×\n")
    print("| where | tokentap µs |" + (" tokentap-base µs |" if base else "") + " fasthttp-relay µs |\n|---|---:|" + ("---:|" if base else "") + "---:|")
    own = shared = apart = 0.0
    for n in names:
        a, b = trows[n], frows.get(n, 0.0)
        mid = f" {brows.get(n, 0.0):.1f} |" if base else ""
        print(f"| {n} | {a:.1f} |{mid} {b:.1f} |")
        if n.startswith(("stream hand-offs", "Go runtime: garbage")):
            apart += a - b
        elif b == 0 and a > 0:
            own += a
        else:
            shared += a - b
    line = f"\ntokentap's own duties (the rows the bare proxy has no part of): {own:.1f} µs a {unit}; the work both do: {shared:+.1f} µs"
    if apart >= 0.05:
        line += f"; the stream's hand-offs and the garbage collector: {apart:+.1f} µs"
    print(line)
PY
