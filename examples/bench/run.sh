#!/usr/bin/env bash
# The side-by-side proxy bench: the same workload, on loopback, straight to
# the simulated backend, through tokentap, through nginx, through HAProxy and
# through a bare Go TCP relay (the floor for a Go proxy), in interleaved
# rounds. Writes docs/bench/results/{results.json,
# results.md,ttft.svg} and the processes' logs. Takes about 10 minutes.
#
#   examples/bench/run.sh                 # everything
#   examples/bench/run.sh -rounds 3 -levels 1,100
#   examples/bench/run.sh -fasthttp-relay # also a bare HTTP proxy on fasthttp
#
# nginx and HAProxy come from Debian: apt-get install nginx-light haproxy
# (as root). Without them the bench runs the other arms and says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
args=()
command -v nginx >/dev/null || { echo "nginx not installed: skipping its arm" >&2; args+=(-nginx ""); }
command -v haproxy >/dev/null || { echo "haproxy not installed: skipping its arm" >&2; args+=(-haproxy ""); }
exec go run ./cmd/tokentap-bench proxies -out docs/bench/results \
  -nginx "$(command -v nginx || true)" -haproxy "$(command -v haproxy || true)" "${args[@]}" "$@"
