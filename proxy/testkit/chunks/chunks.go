// Package chunks makes chunked bodies for tests: a payload framed in
// random chunks, with the size lines and extensions servers send.
package chunks

import (
	"bytes"
	"math/rand/v2"
	"strconv"
	"strings"
)

// Random frames payload in chunks of random sizes, with the spellings
// the grammar allows (upper and lower hex, leading zeros, whitespace and
// extensions after the size, trailers), and returns the body and the offset
// at which each chunk begins, the last chunk's last.
func Random(r *rand.Rand, payload []byte) (body []byte, starts []int) {
	var b bytes.Buffer
	for len(payload) > 0 {
		starts = append(starts, b.Len())
		n := min(len(payload), 1+r.IntN(300))
		size := strconv.FormatInt(int64(n), 16)
		switch r.IntN(4) {
		case 0:
			size = strings.ToUpper(size)
		case 1:
			size = "00" + size
		}
		b.WriteString(size)
		switch r.IntN(4) {
		case 0:
			b.WriteString(" \t")
		case 1:
			b.WriteString(`;name="v a"`)
		}
		b.WriteString("\r\n")
		b.Write(payload[:n])
		b.WriteString("\r\n")
		payload = payload[n:]
	}
	starts = append(starts, b.Len())
	b.WriteString("0\r\n")
	if r.IntN(3) == 0 {
		b.WriteString("X-Trailer: 1\r\nServer-Timing: x;dur=2\r\n")
	}
	b.WriteString("\r\n")
	return b.Bytes(), starts
}
