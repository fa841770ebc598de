# syntax=docker/dockerfile:1
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/tokentap ./cmd/tokentap \
 && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/mockllm ./cmd/mockllm

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/tokentap /out/mockllm /usr/local/bin/
EXPOSE 8080
USER nonroot
ENTRYPOINT ["/usr/local/bin/tokentap"]
