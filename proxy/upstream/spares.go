package upstream

import (
	"bufio"

	"github.com/tokentap/tokentap/proxy/internal/relayplane"
)

// spareReaders are upstream connections' readers, let go of while a relay
// loop reads the socket (Conn.parkReader); the relay's read buffers are
// the relay plane's (relayplane.NewBuf).
var spareReaders = make(relayplane.Spares[*bufio.Reader], 128)

// newUpReader returns a kept reader of c, or a new one.
func newUpReader(c *Conn) *bufio.Reader {
	if br, ok := spareReaders.Get(); ok {
		br.Reset(c)
		return br
	}
	return bufio.NewReaderSize(c, upReadBuffer)
}
