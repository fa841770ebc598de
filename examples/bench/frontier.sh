#!/usr/bin/env bash
# The frontier bench, as public comparisons of LLM gateways measure:
# open-loop (Poisson) arrivals against a backend that takes 20 ms, every arm
# under the same CPU limit (direct, tokentap, nginx, HAProxy, a bare Go TCP
# relay, a bare fasthttp proxy, Portkey's gateway), and per arm the added p99
# at one client, the throughput frontier at 1, 5 and 10 ms of added p99, the
# stream ceiling, the added TTFT p99 with 512 streams in flight, memory per
# 1,000 idle streams and CPU per request; then what each of tokentap's
# measuring features costs (A/B of tokentap variants). Writes
# docs/bench/frontier/{results.json,results.md,frontier.svg} and the
# processes' logs. About 35 minutes with the default 3 rounds.
#
#   examples/bench/frontier.sh                      # everything
#   examples/bench/frontier.sh -rounds 1 -costs=false
#   examples/bench/frontier.sh -gomaxprocs 2
#
# nginx and HAProxy come from Debian (apt-get install nginx-light haproxy, as
# root). Portkey's gateway and Bun, which runs it (on Node 20 and 22 its
# streamed responses fail), come from npm into PORTKEY_DIR (default
# ~/.cache/tokentap-bench/portkey); without npm the bench runs the other arms
# and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${PORTKEY_DIR:-$HOME/.cache/tokentap-bench/portkey}
args=()
if [ ! -x "$dir/node_modules/.bin/bun" ] || [ ! -f "$dir/node_modules/@portkey-ai/gateway/build/start-server.js" ]; then
  if command -v npm >/dev/null; then
    mkdir -p "$dir"
    npm install --prefix "$dir" --no-audit --no-fund @portkey-ai/gateway@1.15.2 bun@1.4.5 >&2 || true
  fi
fi
if [ -x "$dir/node_modules/.bin/bun" ] && [ -f "$dir/node_modules/@portkey-ai/gateway/build/start-server.js" ]; then
  args+=(-portkey "$dir/node_modules/@portkey-ai/gateway/build/start-server.js" -js-runtime "$dir/node_modules/.bin/bun")
else
  echo "Portkey's gateway or Bun not installed (npm): skipping its arm" >&2
fi
command -v nginx >/dev/null || echo "nginx not installed: skipping its arm" >&2
command -v haproxy >/dev/null || echo "haproxy not installed: skipping its arm" >&2
exec go run ./cmd/tokentap-bench frontier -out docs/bench/frontier \
  -nginx "$(command -v nginx || true)" -haproxy "$(command -v haproxy || true)" "${args[@]}" "$@"
