package sse

import (
	"strings"
	"testing"
)

// openAIStream is 100 chat completion chunks as vLLM sends them.
var openAIStream = []byte(strings.Repeat(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":" token"},"finish_reason":null}]}`+"\n\n", 100))

func BenchmarkParserPerEvent(b *testing.B) {
	p := NewParser(1 << 20)
	b.ReportAllocs()
	b.SetBytes(int64(len(openAIStream)) / 100)
	n := 0
	for b.Loop() {
		if n%100 == 0 {
			p.Feed(openAIStream)
		}
		if !p.Next() {
			p.Feed(openAIStream)
			p.Next()
		}
		n++
	}
}

func BenchmarkParserOneEventPerRead(b *testing.B) {
	ev := openAIStream[:len(openAIStream)/100]
	p := NewParser(1 << 20)
	b.ReportAllocs()
	b.SetBytes(int64(len(ev)))
	for b.Loop() {
		p.Feed(ev)
		for p.Next() {
		}
	}
}

func BenchmarkParserSplitReads(b *testing.B) {
	ev := openAIStream[:len(openAIStream)/100]
	p := NewParser(1 << 20)
	b.ReportAllocs()
	b.SetBytes(int64(len(ev)))
	for b.Loop() {
		p.Feed(ev[:50])
		for p.Next() {
		}
		p.Feed(ev[50:])
		for p.Next() {
		}
	}
}

func BenchmarkLinesPerLine(b *testing.B) {
	line := []byte(`{"model":"llama3","created_at":"2024-01-01T00:00:00Z","message":{"role":"assistant","content":" token"},"done":false}` + "\n")
	l := NewLines(1 << 20)
	b.ReportAllocs()
	b.SetBytes(int64(len(line)))
	for b.Loop() {
		l.Feed(line)
		for l.Next() {
		}
	}
}
