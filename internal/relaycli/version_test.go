package relaycli

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"runtime"
	"runtime/debug"
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
		if b.Modified == nil {
			t.Fatalf("modified null, with revision %s", b.Revision)
		}
		if dirty := len(bytes.TrimSpace(st)) > 0; dirty && !*b.Modified {
			t.Errorf("modified false, and tracked files are changed (git status --porcelain: %q)", st)
		} else if *b.Modified != dirty {
			all, _ := exec.Command("git", "status", "--porcelain").Output()
			t.Logf("modified %v; tracked files changed: %v; git status --porcelain: %q", *b.Modified, dirty, all)
		}
		// A stamped build from a checkout has a pseudo-version naming the revision.
		if !strings.Contains(b.Version, b.Revision[:12]) {
			t.Errorf("version %q does not name revision %s", b.Version, b.Revision[:12])
		}
	default:
		t.Logf("the binary carries no VCS information (go build stamps none in a git worktree or without git); checked the rest")
		// Unknown is null, not false (the text form says unknown).
		if b.Modified != nil || !strings.Contains(string(out), `"modified": null`) {
			t.Errorf("relay version --json of a binary without VCS information: modified %v, want null:\n%s", b.Modified, out)
		}
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

// Without VCS information (go install module@version, -buildvcs=false, a git worktree) the
// revision, time and modified flag are unknown: null in the JSON (it said "modified": false),
// unknown in the text; with it, the recorded values, modified false included.
func TestVersionWithoutVCSIsUnknown(t *testing.T) {
	t.Parallel()
	render := func(info *debug.BuildInfo) (map[string]any, string) {
		t.Helper()
		b := buildInfoFrom(info)
		raw, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		var obj map[string]any
		if err := json.Unmarshal(raw, &obj); err != nil {
			t.Fatal(err)
		}
		var text bytes.Buffer
		b.write(&text)
		return obj, text.String()
	}
	main := debug.Module{Path: "github.com/txoutbox/txoutbox", Version: "v1.2.0"}
	for what, info := range map[string]*debug.BuildInfo{
		"no build information": nil,
		"go install @v1.2.0":   {GoVersion: "go1.26.0", Main: main, Settings: []debug.BuildSetting{{Key: "-buildmode", Value: "exe"}}},
	} {
		obj, text := render(info)
		if v, ok := obj["modified"]; !ok || v != nil {
			t.Errorf("%s: JSON modified %v (present %v), want null", what, v, ok)
		}
		if !strings.Contains(text, "modified: unknown") || !strings.Contains(text, "time:     unknown") {
			t.Errorf("%s: text\n%s\nwant modified and time unknown", what, text)
		}
	}
	stamped := &debug.BuildInfo{GoVersion: "go1.26.0", Main: main, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "4ef381428bf98c034a3eb91184ab9aaae37d4f41"}, {Key: "vcs.time", Value: "2026-12-02T19:11:00Z"},
		{Key: "vcs.modified", Value: "false"},
	}}
	obj, text := render(stamped)
	if v, ok := obj["modified"].(bool); !ok || v {
		t.Errorf("stamped build: JSON modified %v, want false", obj["modified"])
	}
	if !strings.Contains(text, "modified: false") || !strings.Contains(text, "revision: 4ef381428bf9") {
		t.Errorf("stamped build: text\n%s", text)
	}
}
