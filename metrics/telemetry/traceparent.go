package telemetry

// parseTraceparent reads a W3C traceparent value (Trace Context level 1):
// version-traceid-parentid-flags in lower-case hex. It reports false for a
// value that is malformed, of version ff, of version 00 with reserved
// flags set, or with an all-zero id, which
// the specification says to ignore (the request then starts a trace of
// its own). A later version is read for its first four fields when what
// follows them starts with '-'. It allocates nothing: it runs on every
// request while tracing.
func parseTraceparent(v []byte) (trace [16]byte, parent [8]byte, sampled, ok bool) {
	if len(v) < 55 || v[2] != '-' || v[35] != '-' || v[52] != '-' {
		return trace, parent, false, false
	}
	ver, ok1 := hexByte(v[0], v[1])
	if !ok1 || ver == 0xff || (ver == 0 && len(v) != 55) || (len(v) > 55 && v[55] != '-') {
		return trace, parent, false, false
	}
	if !hexInto(trace[:], v[3:35]) || !hexInto(parent[:], v[36:52]) {
		return trace, parent, false, false
	}
	flags, ok2 := hexByte(v[53], v[54])
	// Version 00 defines the sampled and random bits only; like the SDK's
	// propagator, a value with others set is not read.
	if !ok2 || (ver == 0 && flags > 3) || trace == [16]byte{} || parent == [8]byte{} {
		return trace, parent, false, false
	}
	return trace, parent, flags&1 == 1, true
}

func hexInto(dst, src []byte) bool {
	for i := range dst {
		b, ok := hexByte(src[2*i], src[2*i+1])
		if !ok {
			return false
		}
		dst[i] = b
	}
	return true
}

func hexByte(hi, lo byte) (byte, bool) {
	h, ok1 := hexDigit(hi)
	l, ok2 := hexDigit(lo)
	return h<<4 | l, ok1 && ok2
}

// hexDigit reads a lower-case hex digit (the specification allows no
// upper case).
func hexDigit(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}
