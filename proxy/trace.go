package proxy

import (
	"encoding/hex"

	"github.com/tokentap/tokentap/metrics"
)

// appendTraceparent appends tc as a W3C traceparent value: version 00, the
// trace, tokentap's span as the parent of the upstream's work, and the
// sampled flag.
func appendTraceparent(dst []byte, tc *metrics.TraceContext) []byte {
	dst = append(dst, "00-"...)
	dst = hex.AppendEncode(dst, tc.TraceID[:])
	dst = append(dst, '-')
	dst = hex.AppendEncode(dst, tc.SpanID[:])
	if tc.Sampled {
		return append(dst, "-01"...)
	}
	return append(dst, "-00"...)
}
