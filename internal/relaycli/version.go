package relaycli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

func init() {
	register(command{name: "version", summary: "print the module version, VCS revision and time, and the Go version (also --version)", run: versionCmd})
}

const versionUsage = `
relay version: what this binary is, from the build information Go records in it: the module
version (a tag such as v1.2.0 for 'go install ...@v1.2.0', a pseudo-version or (devel) for a
build from a checkout), the VCS revision, its commit time and whether the work tree had
uncommitted changes (builds from a checkout only), and the Go version that built it.

Usage:
  relay version [--json]
  relay --version
`

// BuildInfo is what `relay version` prints.
type BuildInfo struct {
	// Module is the main module's path, Version its version: a tag (v1.2.0), a pseudo-version
	// or "(devel)".
	Module  string `json:"module"`
	Version string `json:"version"`
	// Revision, Time and Modified come from the VCS (builds from a checkout); "", "" and nil
	// (JSON null: unknown, not false) when the binary was built without them (go install
	// module@version, -buildvcs=false, a build in a git worktree).
	Revision string `json:"revision"`
	Time     string `json:"time"`
	Modified *bool  `json:"modified"`
	// GoVersion is the toolchain that built the binary; Platform its GOOS/GOARCH.
	GoVersion string `json:"go_version"`
	Platform  string `json:"platform"`
}

// ReadBuildInfo returns this binary's build information (runtime/debug.ReadBuildInfo).
func ReadBuildInfo() BuildInfo {
	info, _ := debug.ReadBuildInfo() // nil when the binary carries none
	return buildInfoFrom(info)
}

// buildInfoFrom is ReadBuildInfo of the information Go recorded (nil: none).
func buildInfoFrom(info *debug.BuildInfo) BuildInfo {
	b := BuildInfo{Module: "github.com/txoutbox/txoutbox", Version: "(unknown)", GoVersion: runtime.Version(),
		Platform: runtime.GOOS + "/" + runtime.GOARCH}
	if info == nil {
		return b
	}
	if info.Main.Path != "" {
		b.Module = info.Main.Path
	}
	if info.Main.Version != "" {
		b.Version = info.Main.Version
	}
	if info.GoVersion != "" {
		b.GoVersion = info.GoVersion
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			b.Revision = s.Value
		case "vcs.time":
			b.Time = s.Value
		case "vcs.modified":
			m := s.Value == "true"
			b.Modified = &m
		}
	}
	return b
}

func (b BuildInfo) write(w io.Writer) {
	rev, when, mod := b.Revision, b.Time, "unknown"
	if rev == "" {
		rev = "unknown (built without VCS information)"
	}
	if when == "" {
		when = "unknown"
	}
	if b.Modified != nil {
		mod = fmt.Sprint(*b.Modified)
	}
	fmt.Fprintf(w, "relay %s\n", b.Version)
	fmt.Fprintf(w, "  module:   %s\n", b.Module)
	fmt.Fprintf(w, "  revision: %s\n", rev)
	fmt.Fprintf(w, "  time:     %s\n", when)
	fmt.Fprintf(w, "  modified: %s\n", mod)
	fmt.Fprintf(w, "  go:       %s %s\n", b.GoVersion, b.Platform)
}

func versionCmd(_ context.Context, env *Env, args []string) error {
	var asJSON bool
	s := newSettings("version", versionUsage, env.Stderr, env.Getenv)
	s.Bool(&asJSON, "json", "", false, "print a JSON object")
	s.CommandLineOnly("json")
	if err := parseSettings(s, env, args); err != nil {
		return err
	}
	if len(s.Args()) > 0 {
		return usageErr("unexpected arguments %q", s.Args())
	}
	b := ReadBuildInfo()
	if asJSON {
		enc := json.NewEncoder(env.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(b)
	}
	b.write(env.Stdout)
	return nil
}
