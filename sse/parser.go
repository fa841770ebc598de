package sse

import "bytes"

// Event is one dispatched server-sent event.
//
// Type, Data and ID alias the parser's buffers or the input given to Feed:
// they are valid until the next call to Next, Feed or Reset. Copy what you keep.
type Event struct {
	// Type is the value of the last "event" field, empty when there was none
	// (the spec's default type "message").
	Type []byte
	// Data is the event's data lines joined with LF, without the final LF.
	Data []byte
	// ID is the last event ID seen so far in the stream (it persists across
	// events, as the spec requires).
	ID []byte
	// Retry is the reconnection time in milliseconds from a "retry" field in
	// this event, or -1 when the event had none.
	Retry int
	// Truncated reports that the event was larger than the parser's maximum
	// event size: Data holds its first bytes only.
	Truncated bool
}

// Parser is an incremental parser of the text/event-stream format
// (https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation).
//
// Feed it the stream in pieces of any size, then call Next until it returns
// false. It handles LF, CR and CRLF line ends (a CR at the end of one piece
// whose LF starts the next counts once), lines split anywhere, including
// inside a UTF-8 sequence, a single leading byte order mark, comments and
// the event, data, id and retry fields. An event that is still open when the
// stream ends is never dispatched (see Pending).
//
// A Parser is not safe for concurrent use.
type Parser struct {
	max int // max bytes per event (field values and line overhead)

	in  []byte // the unconsumed rest of the input given to Feed
	fed int    // length of the input given to Feed
	pos int    // bytes of stream seen, for BOM detection

	line     []byte // a partial line carried across Feed calls
	lineOver bool   // the carried line exceeded max and was cut

	skipLF bool // the previous piece ended with CR: a leading LF belongs to it

	// Fields of the event being built.
	data      []byte // joined data lines, each followed by LF
	dataView  []byte // the event's only data line, still aliasing the input
	hasData   bool
	evType    []byte
	id        []byte
	retry     int
	size      int // bytes of the event so far, for the size bound
	truncated bool

	ev       Event
	comments int
	events   int
}

// NewParser returns a Parser that keeps at most maxEventSize bytes of any
// one event. maxEventSize <= 0 means 1 MiB.
func NewParser(maxEventSize int) *Parser {
	if maxEventSize <= 0 {
		maxEventSize = 1 << 20
	}
	p := &Parser{max: maxEventSize}
	p.Reset()
	return p
}

// Reset makes p ready for a new stream, keeping its buffers.
func (p *Parser) Reset() {
	p.in = nil
	p.pos = 0
	p.line = p.line[:0]
	p.lineOver = false
	p.skipLF = false
	p.id = p.id[:0]
	p.comments = 0
	p.events = 0
	p.resetEvent()
}

func (p *Parser) resetEvent() {
	p.data = p.data[:0]
	p.dataView = nil
	p.hasData = false
	p.evType = p.evType[:0]
	p.retry = -1
	p.size = 0
	p.truncated = false
}

// Feed gives p the next piece of the stream. The piece must stay unchanged
// until Next has returned false; p keeps no reference to it after that.
func (p *Parser) Feed(b []byte) {
	p.in = b
	p.fed = len(b)
}

// Offset returns how many bytes of the input given to Feed have been
// consumed. Right after Next reports an event, it is the offset just past
// the blank line that ended the event.
func (p *Parser) Offset() int { return p.fed - len(p.in) }

// Next parses until it has an event to dispatch and reports whether it has
// one; the event is then available from Event. It returns false when the
// input given to Feed is used up.
func (p *Parser) Next() bool {
	for len(p.in) > 0 {
		if p.pos < 3 && p.stripBOM() {
			continue
		}
		if p.skipLF {
			p.skipLF = false
			if p.in[0] == '\n' {
				p.advance(1)
				continue
			}
		}
		i := bytes.IndexAny(p.in, "\r\n")
		if i < 0 {
			p.carry(p.in)
			p.advance(len(p.in))
			break
		}
		var line []byte
		if len(p.line) > 0 || p.lineOver {
			p.carry(p.in[:i])
			line = p.line
		} else {
			line = p.in[:i]
		}
		over := p.lineOver
		if p.in[i] == '\r' {
			if i+1 < len(p.in) {
				if p.in[i+1] == '\n' {
					i++
				}
			} else {
				p.skipLF = true
			}
		}
		p.advance(i + 1)
		dispatch := p.processLine(line, over)
		p.line = p.line[:0]
		p.lineOver = false
		if dispatch {
			return true
		}
	}
	// The input is about to go away: keep what still aliases it, and let
	// go of the rest (the last event is no longer valid), so that no
	// reference keeps the caller's buffer alive.
	if p.dataView != nil {
		p.data = append(p.data[:0], p.dataView...)
		p.data = append(p.data, '\n')
		p.dataView = nil
	}
	p.in = nil
	p.ev.Type, p.ev.Data = nil, nil
	return false
}

// Event returns the event Next just reported. See Event for aliasing.
func (p *Parser) Event() *Event { return &p.ev }

// Pending reports whether an event has been started but not yet dispatched:
// at the end of a stream, such an event is discarded.
func (p *Parser) Pending() bool {
	return p.hasData || len(p.evType) > 0 || len(p.line) > 0 || p.lineOver || p.retry >= 0
}

// Events returns the number of events dispatched since the last Reset.
func (p *Parser) Events() int { return p.events }

// Comments returns the number of comment lines (such as keep-alives) seen
// since the last Reset.
func (p *Parser) Comments() int { return p.comments }

func (p *Parser) advance(n int) {
	p.in = p.in[n:]
	p.pos += n
}

// stripBOM removes one leading U+FEFF (EF BB BF), which may itself arrive
// split across pieces. It reports whether it consumed input.
func (p *Parser) stripBOM() bool {
	const bom = "\xef\xbb\xbf"
	// Bytes of a BOM prefix already seen are held in p.line.
	for p.pos < 3 && len(p.in) > 0 {
		if p.in[0] != bom[p.pos] {
			// Not a BOM after all: give back what was held as line content.
			held := p.pos
			p.pos = 3
			if held > 0 {
				p.line = append(p.line[:0], bom[:held]...)
			}
			return false
		}
		p.in = p.in[1:]
		p.pos++
	}
	return true
}

// lineSlack is how far a carried line may exceed the event size bound, so
// that a bounded line still holds its field name ("data: ", "event: ").
const lineSlack = 16

// carry appends b to the partial line, up to the size bound.
func (p *Parser) carry(b []byte) {
	room := p.max + lineSlack - len(p.line)
	if len(b) > room {
		if room > 0 {
			p.line = append(p.line, b[:room]...)
		}
		p.lineOver = true
		return
	}
	p.line = append(p.line, b...)
}

// processLine applies one line to the event being built and reports whether
// the line dispatched an event. over means the line was cut at the size bound.
func (p *Parser) processLine(line []byte, over bool) bool {
	if len(line) == 0 && !over {
		return p.dispatch()
	}
	if line[0] == ':' {
		p.comments++
		return false
	}
	field, value := line, line[:0]
	if c := bytes.IndexByte(line, ':'); c >= 0 {
		field, value = line[:c], line[c+1:]
		if len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
	}
	switch string(field) {
	case "data":
		p.addData(value, over)
	case "event":
		p.evType = appendBounded(p.evType[:0], value, p.max)
	case "id":
		if bytes.IndexByte(value, 0) < 0 {
			p.id = appendBounded(p.id[:0], value, p.max)
		}
	case "retry":
		if n, ok := parseDigits(value); ok && !over {
			p.retry = n
		}
	}
	return false
}

func (p *Parser) addData(value []byte, over bool) {
	if over {
		p.truncated = true
	}
	room := p.max - p.size
	if len(value) > room {
		value = value[:max(room, 0)]
		p.truncated = true
	}
	p.size += len(value) + 1
	if !p.hasData && !p.truncated && len(p.line) == 0 {
		// The common case, one data line read in one piece: no copy.
		p.dataView = value
		p.hasData = true
		return
	}
	if p.dataView != nil {
		p.data = append(p.data[:0], p.dataView...)
		p.data = append(p.data, '\n')
		p.dataView = nil
	}
	p.data = append(p.data, value...)
	p.data = append(p.data, '\n')
	p.hasData = true
}

func (p *Parser) dispatch() bool {
	if !p.hasData {
		// No data: the spec resets the event without dispatching it.
		p.resetEvent()
		return false
	}
	ev := &p.ev
	if p.dataView != nil {
		ev.Data = p.dataView
	} else {
		ev.Data = p.data[:len(p.data)-1]
	}
	ev.Type = p.evType
	ev.ID = p.id
	ev.Retry = p.retry
	ev.Truncated = p.truncated
	p.events++
	// ev keeps aliasing the buffers; the next event is built over them.
	p.resetEvent()
	return true
}

func parseDigits(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 9 {
		return 0, false
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// appendBounded appends b to dst, keeping dst at most max bytes long.
func appendBounded(dst, b []byte, max int) []byte {
	if room := max - len(dst); len(b) > room {
		b = b[:room]
	}
	return append(dst, b...)
}
