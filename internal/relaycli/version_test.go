package relaycli

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"
)

// relay version and relay --version, run from the real binary built by go build: the module
// path, the Go version that built it, and, when go build could stamp it (a git clone; Go does
// not stamp builds in a git worktree), the revision, commit time and modified flag of the
// checkout.
func TestVersionBinary(t *testing.T) {
	bin := relayBinary(t)
	out, err := exec.Command(bin, "version", "--json").Output()
	if err != nil {
		t.Fatalf("relay version --json: %v\n%s", err, out)
	}
	var b BuildInfo
	if err := json.Unmarshal(out, &b); err != nil {
		t.Fatalf("relay version --json is not a JSON object: %v\n%s", err, out)
	}
	if b.Module != "github.com/txoutbox/txoutbox" || b.Version == "" {
		t.Errorf("module %q version %q", b.Module, b.Version)
	}
	if b.GoVersion != runtime.Version() || b.Platform != runtime.GOOS+"/"+runtime.GOARCH {
		t.Errorf("go %q %q, want %q %s/%s (the toolchain that built it)", b.GoVersion, b.Platform, runtime.Version(), runtime.GOOS, runtime.GOARCH)
	}

	head, gitErr := exec.Command("git", "rev-parse", "HEAD").Output()
	switch {
	case b.Revision != "":
		if gitErr != nil {
			t.Fatalf("the binary has revision %s, and git rev-parse HEAD fails: %v", b.Revision, gitErr)
		}
		if want := strings.TrimSpace(string(head)); b.Revision != want {
			t.Errorf("revision %s, want HEAD %s", b.Revision, want)
		}
		ct, err := exec.Command("git", "log", "-1", "--format=%cI").Output()
		if err != nil {
			t.Fatal(err)
		}
		want, err := time.Parse(time.RFC3339, strings.TrimSpace(string(ct)))
		if err != nil {
			t.Fatal(err)
		}
		if got, err := time.Parse(time.RFC3339, b.Time); err != nil || !got.Equal(want) {
			t.Errorf("time %q, want the commit time %s", b.Time, want.UTC().Format(time.RFC3339))
		}
		// Go counts untracked files as modifications too, and other tests may create some
		// while this one runs: only changed tracked files are sure to make it true.
		st, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output()
		if err != nil {
			t.Fatal(err)
		}
		if dirty := len(bytes.TrimSpace(st)) > 0; dirty && !b.Modified {
			t.Errorf("modified false, and tracked files are changed (git status --porcelain: %q)", st)
		} else if b.Modified != dirty {
			all, _ := exec.Command("git", "status", "--porcelain").Output()
			t.Logf("modified %v; tracked files changed: %v; git status --porcelain: %q", b.Modified, dirty, all)
		}
		// A stamped build from a checkout has a pseudo-version naming the revision.
		if !strings.Contains(b.Version, b.Revision[:12]) {
			t.Errorf("version %q does not name revision %s", b.Version, b.Revision[:12])
		}
	default:
		t.Logf("the binary carries no VCS information (go build stamps none in a git worktree or without git); checked the rest")
	}

	// The text form says the same, and --version is the same command.
	text, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatalf("relay version: %v", err)
	}
	flag, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatalf("relay --version: %v", err)
	}
	if !bytes.Equal(text, flag) {
		t.Errorf("relay --version differs from relay version:\n%s\n%s", flag, text)
	}
	for _, want := range []string{"relay " + b.Version + "\n", "module:   " + b.Module, "go:       " + b.GoVersion} {
		if !strings.Contains(string(text), want) {
			t.Errorf("relay version lacks %q:\n%s", want, text)
		}
	}
	if b.Revision != "" && !strings.Contains(string(text), "revision: "+b.Revision) {
		t.Errorf("relay version lacks the revision:\n%s", text)
	}
}
