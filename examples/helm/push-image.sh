#!/usr/bin/env bash
# Builds tokentap's image from this checkout, with its version stamped
# (tokentap -version, tokentap_build_info), pushes it, and prints the values
# that point the chart at it. tokentap publishes no image of its own: the
# chart installs the one you push.
#
#   examples/helm/push-image.sh registry.example.com/platform/tokentap [VERSION]
#
# VERSION defaults to `git describe --tags --always --dirty`. DRY_RUN=1
# prints the commands instead of running them. Needs docker (or
# DOCKER=podman) logged in to the registry.
set -euo pipefail
repo=${1:?usage: push-image.sh REGISTRY/REPOSITORY [VERSION]}
cd "$(dirname "$0")/../.."
version=${2:-$(git describe --tags --always --dirty 2>/dev/null || echo dev)}
docker=${DOCKER:-docker}
run() {
  if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi
}
run "$docker" build --build-arg "VERSION=$version" -t "$repo:$version" .
run "$docker" push "$repo:$version"
cat <<MSG
pushed $repo:$version; install the chart with it:
  helm install tt examples/helm/tokentap -f my-values.yaml --set image.repository=$repo --set image.tag=$version
or render it without installing:
  helm template tt examples/helm/tokentap -f my-values.yaml --set image.repository=$repo --set image.tag=$version
MSG
