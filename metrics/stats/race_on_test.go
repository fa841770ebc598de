//go:build race

package stats

// raceEnabled: the race detector slows the simulations about fivefold;
// the longest run fewer rounds under it.
const raceEnabled = true
