//go:build race

package sock

import "syscall"

// Write, under the race detector, writes through syscall.Write, whose
// annotations order a write before the peer's read of its bytes: a test
// that reads what a handler set once the response arrived is not a race.
// The bookkeeping this adds (the runtime's monitor woken) changes the CPU
// a write costs, not what it does.
func Write(fd uintptr, b []byte) (int, syscall.Errno) {
	n, err := syscall.Write(int(fd), b)
	if err != nil {
		return max(n, 0), err.(syscall.Errno)
	}
	return n, 0
}
