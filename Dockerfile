# syntax=docker/dockerfile:1
# tokentap's image holds the tokentap binary only:
#   docker build --build-arg VERSION=v1.2.3 -t tokentap .
# The simulated backend has a target of its own:
#   docker build --target mockllm -t tokentap-mockllm .
# The build runs on the builder's platform and cross-compiles for the
# target's (docker buildx build --platform linux/amd64,linux/arm64: one
# image for both, as examples/release/release.sh builds it).
FROM --platform=$BUILDPLATFORM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG TARGETARCH
# cmd/tokentap's TestDockerfileBuild runs this line as it stands.
RUN CGO_ENABLED=0 GOARCH=${TARGETARCH:-$(go env GOARCH)} go build -trimpath -ldflags="-s -w -X main.version=${VERSION}" -o /out/tokentap ./cmd/tokentap

FROM build AS mockllm-build
ARG TARGETARCH
RUN CGO_ENABLED=0 GOARCH=${TARGETARCH:-$(go env GOARCH)} go build -trimpath -ldflags="-s -w" -o /out/mockllm ./cmd/mockllm

FROM gcr.io/distroless/static-debian12:nonroot AS mockllm
COPY --from=mockllm-build /out/mockllm /usr/local/bin/mockllm
EXPOSE 8000
USER nonroot
ENTRYPOINT ["/usr/local/bin/mockllm", "-listen", ":8000"]

# The default target, last: tokentap alone.
FROM gcr.io/distroless/static-debian12:nonroot AS tokentap
COPY --from=build /out/tokentap /usr/local/bin/tokentap
# 8080: the proxy; 9090: the admin listener (/metrics, /healthz, /readyz),
# which listens on loopback unless -admin :9090 is given.
EXPOSE 8080 9090
USER nonroot
ENTRYPOINT ["/usr/local/bin/tokentap"]
