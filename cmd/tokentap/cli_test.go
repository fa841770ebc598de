package main

import (
	"bufio"
	"bytes"
	"debug/elf"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tokentap/tokentap/proxy/testkit/wait"
)

// buildAsTheDockerfile builds tokentap with the Dockerfile's own build
// line (its flags, CGO_ENABLED=0), VERSION set to version, and returns the
// binary's path. No container engine runs here; the line does.
func buildAsTheDockerfile(t *testing.T, version string) string {
	t.Helper()
	df, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	var line string
	for _, l := range strings.Split(string(df), "\n") {
		if strings.HasPrefix(l, "RUN ") && strings.Contains(l, "-o /out/tokentap ") {
			line = strings.TrimPrefix(l, "RUN ")
		}
	}
	if !strings.HasPrefix(line, "CGO_ENABLED=0 ") || !strings.Contains(line, " go build ") {
		t.Fatalf("the Dockerfile's tokentap build line is %q", line)
	}
	bin := filepath.Join(t.TempDir(), "tokentap")
	line = strings.NewReplacer("${VERSION}", version, "/out/tokentap", bin).Replace(line)
	cmd := exec.Command("sh", "-c", line)
	cmd.Dir = "../.."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", line, err, out)
	}
	return bin
}

// TestDockerfileBuild: the image's binary, built as the Dockerfile builds
// it, reports the version it was given; the runtime image holds tokentap
// alone and the build context leaves .git and test data out.
func TestDockerfileBuild(t *testing.T) {
	wait.Long(t, "a build of the binary")
	df, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	stages := strings.Split(string(df), "\nFROM ")
	last := stages[len(stages)-1]
	if !strings.Contains(last, "AS tokentap") || strings.Count(last, "COPY ") != 1 || !strings.Contains(last, "COPY --from=build /out/tokentap /usr/local/bin/tokentap") {
		t.Errorf("the default (last) stage should copy tokentap alone:\nFROM %s", last)
	}
	ignore, err := os.ReadFile("../../.dockerignore")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{".git", "**/testdata"} {
		if !strings.Contains("\n"+string(ignore)+"\n", "\n"+want+"\n") {
			t.Errorf(".dockerignore lacks %s", want)
		}
	}
	bin := buildAsTheDockerfile(t, "v9.8.7-test")
	out, err := exec.Command(bin, "-version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "tokentap v9.8.7-test ") {
		t.Fatalf("-version: %v %q", err, out)
	}
}

// TestCommandLine tries the binary as a newcomer does: -h, a subcommand's
// -h, stats against a host:port, a bad flag, and the process log of a run
// whose reload is refused.
func TestCommandLine(t *testing.T) {
	wait.Long(t, "a build of the binary and its runs")
	bin := filepath.Join(t.TempDir(), "tokentap")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	out, err := exec.Command(bin, "-h").Output()
	if err != nil {
		t.Fatalf("-h: %v", err)
	}
	for _, want := range []string{"tokentap demo", "tokentap stats", "tokentap compare", "-upstream", "-version"} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("-h lacks %q:\n%s", want, out)
		}
	}
	if out, err := exec.Command(bin, "stats", "-h").CombinedOutput(); err != nil || !bytes.Contains(out, []byte("-group-by")) {
		t.Errorf("stats -h: %v\n%s", err, out)
	}
	if out, err := exec.Command(bin, "-bogus").CombinedOutput(); exitCode(err) != 2 || !bytes.Contains(out, []byte("-bogus")) {
		t.Errorf("-bogus: %v\n%s", err, out)
	}
	// Nothing listens there: the error is the connection's, not the
	// address's form.
	dead := freeAddr(t)
	for _, sub := range []string{"stats", "compare"} {
		args := []string{sub, "-admin", dead}
		if sub == "compare" {
			args = append(args, "-route", "r")
		}
		out, err := exec.Command(bin, args...).CombinedOutput()
		if exitCode(err) != 1 || !bytes.Contains(out, []byte("connection refused")) {
			t.Errorf("%s -admin %s: %v\n%s", sub, dead, err, out)
		}
	}

	// The process log: ISO-8601 times, no stack trace for a refused reload.
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(cfg, []byte("upstream: http://127.0.0.1:1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	admin := freeAddr(t)
	cmd := exec.Command(bin, "-config", cfg, "-listen", "127.0.0.1:0", "-admin", admin, "-access-log", "")
	var logBuf bytes.Buffer
	cmd.Stderr = &logBuf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	waitUp(t, "http://"+admin+"/healthz")
	if err := os.WriteFile(cfg, []byte("upstream: http://127.0.0.1:1\nslo: {ttft: 500}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+admin+"/-/reload", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Errorf("a bad reload answered %d", resp.StatusCode)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("tokentap exited: %v\n%s", err, logBuf.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("tokentap did not stop on SIGTERM")
	}
	iso := regexp.MustCompile(`^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}(Z|[+-]\d{4})$`)
	var refused bool
	sc := bufio.NewScanner(&logBuf)
	for sc.Scan() {
		var l map[string]any
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if ts, _ := l["time"].(string); !iso.MatchString(ts) {
			t.Errorf("time %v is not ISO-8601: %s", l["time"], sc.Text())
		}
		if _, ok := l["stacktrace"]; ok {
			t.Errorf("a stack trace: %s", sc.Text())
		}
		if strings.Contains(sc.Text(), "reload refused") {
			refused = true
			if e, _ := l["error"].(string); !strings.Contains(e, `c.yaml:2: slo.ttft: "500" is not a duration`) {
				t.Errorf("refused reload: %s", sc.Text())
			}
		}
	}
	if !refused {
		t.Errorf("no refused reload in the log:\n%s", logBuf.String())
	}
}

func exitCode(err error) int {
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

// TestReleaseScript runs examples/release/release.sh as a release is made
// (for this machine's architecture alone, without the image: the script's
// default is amd64 and arm64, and the image with docker buildx): its
// archive holds a static binary that says the version given, the README
// and the example config; the chart's archive names the version as its
// appVersion; the sums cover both.
func TestReleaseScript(t *testing.T) {
	wait.Long(t, "a build of the release")
	if testing.Short() {
		t.Skip("builds tokentap once more (-short)")
	}
	script, err := os.ReadFile("../../examples/release/release.sh")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(script), `archs=${ARCHS:-amd64 arm64}`) {
		t.Error("the release's architectures are not amd64 and arm64 by default")
	}
	dist := t.TempDir()
	cmd := exec.Command("bash", "examples/release/release.sh", "v9.9.9-rel")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "DIST="+dist, "ARCHS="+runtime.GOARCH, "NO_IMAGE=1")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("release.sh: %v\n%s", err, out)
	}
	name := "tokentap_v9.9.9-rel_linux_" + runtime.GOARCH
	x := t.TempDir()
	for _, a := range []string{name + ".tar.gz", "tokentap-chart_v9.9.9-rel.tgz"} {
		if out, err := exec.Command("tar", "-C", x, "-xzf", filepath.Join(dist, a)).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", a, err, out)
		}
	}
	bin := filepath.Join(x, name, "tokentap")
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			t.Error("the released binary is dynamically linked")
		}
	}
	f.Close()
	if out, err := exec.Command(bin, "-version").CombinedOutput(); err != nil || !strings.HasPrefix(string(out), "tokentap v9.9.9-rel ") {
		t.Errorf("-version: %v %q", err, out)
	}
	for _, p := range []string{filepath.Join(x, name, "README.md"), filepath.Join(x, name, "tokentap.yaml")} {
		if _, err := os.Stat(p); err != nil {
			t.Error(err)
		}
	}
	chart, _ := os.ReadFile(filepath.Join(x, "tokentap", "Chart.yaml"))
	if !strings.Contains(string(chart), `appVersion: "v9.9.9-rel"`) {
		t.Errorf("the chart's archive:\n%s", chart)
	}
	sums, _ := os.ReadFile(filepath.Join(dist, "tokentap_v9.9.9-rel_SHA256SUMS"))
	if !strings.Contains(string(sums), name+".tar.gz") || !strings.Contains(string(sums), "tokentap-chart_v9.9.9-rel.tgz") {
		t.Errorf("sums:\n%s", sums)
	}
}
