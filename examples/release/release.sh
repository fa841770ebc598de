#!/usr/bin/env bash
# Builds a tokentap release from this checkout: a static binary for each of
# linux/amd64 and linux/arm64 (CGO off, -trimpath, the version stamped as
# tokentap -version and tokentap_build_info say it), each in a tar.gz with
# the README and the example config; the Helm chart with the version as its
# appVersion; their SHA-256 sums; and the image for both platforms from the
# Dockerfile.
#
#   examples/release/release.sh [VERSION]
#
# VERSION defaults to `git describe --tags --always --dirty`. DIST (dist/)
# is where the archives go; ARCHS ("amd64 arm64") the architectures;
# IMAGE (ghcr.io/tokentap/tokentap, the chart's default repository) the
# image's name, tagged VERSION; PUSH=1 pushes it (docker buildx, logged in
# to the registry), NO_IMAGE=1 skips it; DRY_RUN=1 prints the image's
# commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:-$(git describe --tags --always --dirty 2>/dev/null || echo dev)}
dist=${DIST:-dist}
archs=${ARCHS:-amd64 arm64}
image=${IMAGE:-ghcr.io/tokentap/tokentap}
mkdir -p "$dist"
sums=()
for arch in $archs; do
  name="tokentap_${version}_linux_${arch}"
  dir=$(mktemp -d)
  mkdir -p "$dir/$name"
  # The Dockerfile's build line, for another architecture.
  CGO_ENABLED=0 GOOS=linux GOARCH="$arch" go build -trimpath -ldflags="-s -w -X main.version=${version}" \
    -o "$dir/$name/tokentap" ./cmd/tokentap
  cp README.md configs/tokentap.yaml "$dir/$name/"
  tar -C "$dir" -czf "$dist/$name.tar.gz" "$name"
  rm -rf "$dir"
  sums+=("$name.tar.gz")
  echo "built $dist/$name.tar.gz"
done
# The chart, its appVersion the release's: by default it installs this
# release's image.
chart=$(mktemp -d)
cp -r examples/helm/tokentap "$chart/tokentap"
sed -i "s/^appVersion: .*/appVersion: \"${version}\"/" "$chart/tokentap/Chart.yaml"
tar -C "$chart" -czf "$dist/tokentap-chart_${version}.tgz" tokentap
rm -rf "$chart"
sums+=("tokentap-chart_${version}.tgz")
echo "built $dist/tokentap-chart_${version}.tgz"
(cd "$dist" && sha256sum "${sums[@]}" > "tokentap_${version}_SHA256SUMS")
echo "sums in $dist/tokentap_${version}_SHA256SUMS"
if [ -n "${NO_IMAGE:-}" ]; then
  exit 0
fi
run() {
  if [ -n "${DRY_RUN:-}" ]; then echo "+ $*"; else "$@"; fi
}
platforms=$(for a in $archs; do printf 'linux/%s,' "$a"; done)
push=--load
if [ -n "${PUSH:-}" ]; then push=--push; fi
run docker buildx build --platform "${platforms%,}" --build-arg "VERSION=$version" -t "$image:$version" "$push" .
echo "image $image:$version (helm: --set image.tag=$version)"
