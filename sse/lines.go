package sse

import "bytes"

// Lines splits a newline-delimited stream (NDJSON, JSON Lines) into lines,
// incrementally and with the same guarantees as Parser: pieces of any size,
// LF or CRLF line ends, bounded memory, no allocation per line in steady
// state. Empty lines are skipped. A last line without its LF is never
// reported (see Pending).
//
// A Lines is not safe for concurrent use.
type Lines struct {
	max       int
	in        []byte
	buf       []byte
	over      bool
	line      []byte
	truncated bool
	lines     int
}

// NewLines returns a Lines that keeps at most maxLineSize bytes of any one
// line. maxLineSize <= 0 means 1 MiB.
func NewLines(maxLineSize int) *Lines {
	if maxLineSize <= 0 {
		maxLineSize = 1 << 20
	}
	return &Lines{max: maxLineSize}
}

// Reset makes l ready for a new stream, keeping its buffers.
func (l *Lines) Reset() {
	l.in = nil
	l.buf = l.buf[:0]
	l.over = false
	l.line = nil
	l.truncated = false
	l.lines = 0
}

// Feed gives l the next piece of the stream, which must stay unchanged
// until Next has returned false.
func (l *Lines) Feed(b []byte) { l.in = b }

// Next reports whether a complete line is available from Line.
func (l *Lines) Next() bool {
	for len(l.in) > 0 {
		i := bytes.IndexByte(l.in, '\n')
		if i < 0 {
			l.carry(l.in)
			break
		}
		var line []byte
		truncated := false
		if len(l.buf) > 0 || l.over {
			l.carry(l.in[:i])
			line, truncated = l.buf, l.over
		} else {
			line = l.in[:i]
			if len(line) > l.max {
				line, truncated = line[:l.max], true
			}
		}
		l.in = l.in[i+1:]
		l.buf = l.buf[:0]
		l.over = false
		if n := len(line); n > 0 && line[n-1] == '\r' && !truncated {
			line = line[:n-1]
		}
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		l.line, l.truncated = line, truncated
		l.lines++
		return true
	}
	// The input is used up: no reference to it is kept (the last line is
	// no longer valid).
	l.in, l.line = nil, nil
	return false
}

// Line returns the line Next just reported, without its line end. It aliases
// l's buffer or the input given to Feed and is valid until the next call to
// Next, Feed or Reset.
func (l *Lines) Line() []byte { return l.line }

// Truncated reports whether the current line was longer than the maximum
// and Line holds only its first bytes.
func (l *Lines) Truncated() bool { return l.truncated }

// Pending reports whether part of an unterminated line is held.
func (l *Lines) Pending() bool { return len(l.buf) > 0 || l.over }

// Count returns the number of lines reported since the last Reset.
func (l *Lines) Count() int { return l.lines }

func (l *Lines) carry(b []byte) {
	room := l.max - len(l.buf)
	if len(b) > room {
		l.buf = append(l.buf, b[:room]...)
		l.over = true
		return
	}
	l.buf = append(l.buf, b...)
}
