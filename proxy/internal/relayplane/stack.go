package relayplane

// GrowStack grows the calling goroutine's stack, in one copy while the
// goroutine is still shallow, to what serving a request takes. A
// goroutine starts small and doubles its stack each time a call would
// overflow it, copying every frame below and walking each one's stack map
// to adjust its pointers; the goroutines a stream starts (the hijack's,
// the one that carries the connection on after the relay loop) used to
// grow deep inside fasthttp's and gjson's frames, two or three copies of
// twenty frames each: 7% of the CPU of short streams. stackPad brings a
// fresh 2 KiB stack to 16 KiB, the largest size the runtime still takes
// from its per-P stack cache; what it does not reach is grown as before.
//
//go:noinline
func GrowStack() {
	var pad [stackPad]byte
	touchPad(pad[:])
}

//go:noinline
func touchPad(b []byte) { b[len(b)-1] = 1 }

const stackPad = 8 << 10
