package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is set at build time:
//
//	go build -ldflags "-X main.version=v1.4.0" ./cmd/tokentap
//
// Without it, the module version and VCS revision the Go toolchain stamped
// into the binary are used (debug.ReadBuildInfo).
var version string

// buildVersion returns the version and VCS revision of this binary
// ("(devel)" and "unknown" when nothing says).
func buildVersion() (ver, revision string) {
	ver, revision = version, "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		if ver == "" && bi.Main.Version != "" {
			ver = bi.Main.Version
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				revision = s.Value
			}
		}
	}
	if ver == "" {
		ver = "(devel)"
	}
	return ver, revision
}

// versionLine is what -version prints.
func versionLine() string {
	ver, rev := buildVersion()
	return fmt.Sprintf("tokentap %s (revision %s, %s %s/%s)", ver, rev, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
