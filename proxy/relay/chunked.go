package relay

import "errors"

// chunkScanner follows HTTP/1.1 chunked framing (RFC 9112 §7.1) across
// reads of any size, so that a chunked upstream body can be relayed to a
// chunked client with its framing as it came: every read is written once,
// whole, and only the data bytes are handed to the parser.
//
// It holds no bytes and allocates nothing. A size line or trailer line is
// bounded (maxChunkLine); anything else that is not chunked framing is
// errBadChunk, as fasthttp's reader would report it.
type chunkScanner struct {
	state   chunkState
	left    int64 // data bytes left in the current chunk
	digits  int   // hex digits of the size line read so far
	line    int   // bytes of the current size or trailer line
	trailer int   // bytes of the trailer section so far
}

type chunkState uint8

const (
	chunkSize      chunkState = iota // hex digits
	chunkSizeWS                      // right after the digits: ";", CR, or spaces and tabs
	chunkSizeTrail                   // spaces or tabs after the digits: more, then CR (";" after them is refused, as net/http does)
	chunkExt                         // after ";": the extensions, up to CR
	chunkSizeLF                      // LF ending the size line
	chunkData                        // left data bytes
	chunkDataCR                      // CR after the data
	chunkDataLF                      // LF after the data
	chunkTrailer                     // a trailer line, or the empty line ending the body
	chunkTrailerLF                   // LF ending a trailer line
	chunkDone                        // the body ended
)

// maxChunkLine bounds a size line with its extensions and each trailer
// line; maxTrailer bounds the whole trailer section.
const (
	maxChunkLine = 4 << 10
	maxTrailer   = 16 << 10
)

var errBadChunk = errors.New("malformed chunked encoding")

// next scans p from its start through the next data bytes, which it
// returns with the count of p it consumed (framing before the data, and the
// data). It also returns, with no data, at the end and at the start of each
// size line, so that the caller can note where the last chunk begins, and
// when p ends in framing. After the body's last byte (the CRLF ending the
// trailer section) it consumes nothing more: what follows in p is not part
// of the response.
func (s *chunkScanner) next(p []byte) (data []byte, n int, err error) {
	for n < len(p) {
		switch s.state {
		case chunkData:
			k := int(min(int64(len(p)-n), s.left))
			s.left -= int64(k)
			if s.left == 0 {
				s.state = chunkDataCR
			}
			return p[n : n+k], n + k, nil
		case chunkDone:
			return nil, n, nil
		}
		c := p[n]
		n, s.line = n+1, s.line+1
		if s.line > maxChunkLine {
			return nil, n, errBadChunk
		}
		switch s.state {
		case chunkSize:
			if v, ok := hexValue(c); ok {
				if s.digits == 15 { // 16 hex digits could overflow int64
					return nil, n, errBadChunk
				}
				s.left = s.left<<4 | int64(v)
				s.digits++
				continue
			}
			if s.digits == 0 {
				return nil, n, errBadChunk
			}
			s.state = chunkSizeWS
			fallthrough
		case chunkSizeWS, chunkSizeTrail:
			switch {
			case c == ' ' || c == '\t':
				s.state = chunkSizeTrail
			case c == ';' && s.state == chunkSizeWS:
				s.state = chunkExt
			case c == '\r':
				s.state = chunkSizeLF
			default:
				return nil, n, errBadChunk
			}
		case chunkExt:
			switch {
			case c == '\r':
				s.state = chunkSizeLF
			case c == '\n' || c < ' ' && c != '\t' || c == 0x7f:
				return nil, n, errBadChunk
			}
		case chunkSizeLF:
			if c != '\n' {
				return nil, n, errBadChunk
			}
			s.digits, s.line = 0, 0
			if s.left == 0 {
				s.state = chunkTrailer
			} else {
				s.state = chunkData
			}
			return nil, n, nil // a size line ends: the caller can tell the last chunk's
		case chunkDataCR, chunkDataLF: // CR, then LF, after the data
			if want := "\r\n"[s.state-chunkDataCR]; c != want {
				return nil, n, errBadChunk
			}
			if s.state++; s.state > chunkDataLF {
				s.state, s.line = chunkSize, 0
				return nil, n, nil // a size line starts here
			}
		case chunkTrailer, chunkTrailerLF:
			if err := s.trailerByte(c); err != nil || s.state == chunkDone {
				return nil, n, err
			}
		}
	}
	return nil, n, nil
}

// trailerByte takes byte c of the trailer section (after the last chunk's
// size line): a trailer line, or the empty line that ends the body
// (chunkDone).
func (s *chunkScanner) trailerByte(c byte) error {
	s.trailer++
	if s.state == chunkTrailer {
		switch {
		case c == '\r':
			s.state = chunkTrailerLF
		case c == '\n' || s.trailer > maxTrailer:
			return errBadChunk
		}
		return nil
	}
	if c != '\n' || s.trailer > maxTrailer {
		return errBadChunk
	}
	if s.line == 2 {
		s.state = chunkDone // the empty line: the body ends here
		return nil
	}
	s.state, s.line = chunkTrailer, 0
	return nil
}

// done reports whether the body ended.
func (s *chunkScanner) done() bool { return s.state == chunkDone }

// inSizeLine reports whether the scanner stopped inside a size line, and
// how many of its bytes it has read: the start of the last chunk cannot be
// told from the start of another until the line ends.
func (s *chunkScanner) inSizeLine() (bool, int) {
	switch s.state {
	case chunkSize, chunkSizeWS, chunkSizeTrail, chunkExt, chunkSizeLF:
		return true, s.line
	}
	return false, 0
}

// lastChunk reports whether the scanner is past the last chunk's size
// line: in the trailer section, or done.
func (s *chunkScanner) lastChunk() bool {
	return s.state == chunkTrailer || s.state == chunkTrailerLF || s.state == chunkDone
}

func hexValue(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
