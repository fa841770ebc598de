#!/usr/bin/env bash
# What tokentap's CPU per request is made of, against the bare fasthttp proxy
# (tokentap-bench fasthttp-relay) on the same libraries: each proxy alone on
# one core (GOMAXPROCS=1), non-streamed requests to mockllm (20 ms), first
# closed-loop with 256 in flight (the proxy busy: no idle wake-ups in the
# figure), then open-loop at 1,000/s (the frontier bench's CPU figure).
# perf samples each proxy's stacks; every sample is charged to the first duty
# (below) whose function is on its stack, so the duties' shares add up. CPU
# per request comes from perf's task clock. Needs perf (Debian: linux-perf)
# and permission to profile (root, or kernel.perf_event_paranoid <= 1).
# About 2 minutes. Writes the figures to stdout and the raw profiles to OUT
# (default /tmp/tokentap-cpu-floor), the figures also to OUT/report.md.
#
#   examples/bench/cpu-floor.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/tokentap-cpu-floor}
mkdir -p "$out"
rm -f "$out/access.log"
command -v perf >/dev/null || { echo "perf not installed (apt-get install linux-perf)" >&2; exit 2; }
go build -o "$out/tokentap" ./cmd/tokentap
go build -o "$out/tokentap-bench" ./cmd/tokentap-bench
go build -o "$out/mockllm" ./cmd/mockllm

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mock=127.0.0.1:$(free_port)
listen=127.0.0.1:$(free_port)
admin=127.0.0.1:$(free_port)
GOMAXPROCS=1 "$out/mockllm" -listen "$mock" -prefill-per-token 0 -jitter 0.2 >"$out/mockllm.log" 2>&1 &
mockpid=$!
trap 'kill $mockpid 2>/dev/null || true' EXIT
cat >"$out/tokentap.yaml" <<EOF
listen: "$listen"
admin: "$admin"
upstream: "http://$mock"
relay: loop
access_log: "$out/access.log"
slo: {ttft: 1s, tpot: 100ms, e2e: 30s, target: 99%}
EOF

# Duties, first match wins: NAME|function prefixes on the stack (;-separated).
duties=(
  "peer watch (epoll_ctl add and remove)|proxy.(*peerWatch).start;proxy.(*peerWatch).stop"
  "record: stats sketches, series, SLO, access-log queue|proxy.(*exchange).record"
  "access log writer (zap JSON, write)|metrics.(*AccessLog).run"
  "usage parse of the response (gjson)|proxy.(*exchange).accountBody"
  "client side (TCP_INFO)|proxy.(*clientSide).read"
  "header rewrite (hop-by-hop, X-Forwarded-*, request id)|proxy.prepareRequest;proxy.copyResponseHeader"
  "request parse and route (gjson, dialect)|proxy.(*exchange).readRequest;proxy.(*exchange).pickRoute"
  "pooled-connection check (MSG_PEEK)|proxy.(*upConn).peek"
  "upstream round trip (write, read header)|proxy.(*upConn).send;fasthttp.(*HostClient).Do"
  "upstream pool and attempt bookkeeping|proxy.(*upstream).get;proxy.(*upstream).put;proxy.(*upstreamAttempt).forward;proxy.(*upstreamAttempt).attempt"
  "response write to the client|fasthttp.writeResponse;bufio.(*Writer).Flush"
  "request read from the client|bufio.(*Reader).Peek;fasthttp.(*RequestHeader).readLoop;fasthttp.(*Request).readBodyStream;fasthttp.(*Request).readLimitBody"
  "rest of the request goroutine|fasthttp.(*Server).serveConnCounted"
  "Go runtime: sysmon|runtime.sysmon"
  "Go runtime: scheduler and netpoll while idle|runtime.mcall;runtime.findRunnable"
)

profile() { # NAME LOAD-ARGS... ; the proxy under test is $pid
  local name=$1; shift
  "$out/tokentap-bench" -url "http://$listen/_mock/20ms/0s/v1/chat/completions" -model m -workload tiny \
    -stream=false -duration 14s -requests 0 "$@" >"$out/$name.load" 2>&1 &
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
    function flush(   i, j, k, hit) {
      if (ns == 0) return
      tot++; hit = 0
      for (i = 1; i <= nd && !hit; i++)
        for (k = 1; k <= ns && !hit; k++)
          for (j = 1; j <= np[i]; j++)
            if (index(st[k], pre[i, j]) > 0) { c[i]++; hit = 1; break }
      if (!hit) other++
      ns = 0
    }
    /^$/ { flush(); next }
    { sub(/^[ \t]+[0-9a-f]+ /, ""); st[++ns] = $0 }
    END { flush(); for (i = 1; i <= nd; i++) printf "%s\t%.4f\n", name[i], c[i] / tot; printf "other (kernel and runtime elsewhere)\t%.4f\n", other / tot }' >"$out/$name.duties"
}

run_arm() { # ARM CMD...
  local arm=$1; shift
  GOMAXPROCS=1 "$@" >"$out/$arm.log" 2>&1 &
  pid=$!
  sleep 1
  profile "$arm-busy" -concurrency 256
  profile "$arm-1000" -rate 1000
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

run_arm tokentap "$out/tokentap" -config "$out/tokentap.yaml"
run_arm fasthttp-relay "$out/tokentap-bench" fasthttp-relay -listen "$listen" -upstream "$mock"

report() {
for load in busy 1000; do
  t=$(cat "$out/tokentap-$load.us"); f=$(cat "$out/fasthttp-relay-$load.us")
  echo
  if [ "$load" = busy ]; then echo "## 256 in flight (busy)"; else echo "## 1,000 requests/s, Poisson"; fi
  echo
  echo "CPU per request: tokentap $t µs, fasthttp-relay $f µs ($(awk -v t="$t" -v f="$f" 'BEGIN{printf "%.2f", t/f}')×)"
  echo
  echo "| where | tokentap µs | fasthttp-relay µs |"
  echo "|---|---:|---:|"
  paste "$out/tokentap-$load.duties" "$out/fasthttp-relay-$load.duties" | awk -F'\t' -v t="$t" -v f="$f" \
    '{ printf "| %s | %.1f | %.1f |\n", $1, $2 * t, $4 * f }'
  echo
  paste "$out/tokentap-$load.duties" "$out/fasthttp-relay-$load.duties" | awk -F'\t' -v t="$t" -v f="$f" '
    $4 == 0 && $2 > 0 { own += $2 * t; next }
    { shared += $2 * t - $4 * f }
    END { printf "tokentap'"'"'s own duties (the rows the bare proxy has no part of): %.1f µs a request; the work both do: %+.1f µs\n", own, shared }'
done
}
report | tee "$out/report.md"
