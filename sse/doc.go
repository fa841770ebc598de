// Package sse frames byte streams into events, passively and incrementally.
//
// It owns framing only: the WHATWG server-sent events parser ([Parser]) and an
// NDJSON line splitter ([Lines]). Bytes go in exactly as they were read from
// the network, in pieces of any size; complete events come out. Neither type
// allocates per event once its buffers have grown to the size of the largest
// event seen, and both bound the memory they hold: an event (or line) larger
// than the configured maximum is reported with Truncated set and the bytes
// beyond the limit are skipped, never buffered.
//
// There is no HTTP and no JSON here, and the package imports only the
// standard library.
//
// Usage:
//
//	p := sse.NewParser(1 << 20)
//	for chunk := range reads {
//		p.Feed(chunk)
//		for p.Next() {
//			ev := p.Event()
//			// ev.Data aliases p's buffers or chunk: copy what you keep.
//		}
//	}
package sse
