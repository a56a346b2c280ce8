// Package natsver checks the version of the nats-server a connection reached (from its INFO)
// against what a component needs. Its error is txoutbox.ServerVersionError.
package natsver

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox"
)

// Check returns a *ServerVersionError when the server nc is connected to announced a version
// older than required. A connection that is not connected (no INFO to go by) or a version that
// does not parse passes: the check refuses only a server known to be too old.
func Check(nc *nats.Conn, component, feature, required string) error {
	if nc == nil {
		return nil
	}
	return CheckVersion(nc.ConnectedServerVersion(), component, feature, required)
}

// CheckVersion is Check on a version string.
func CheckVersion(server, component, feature, required string) error {
	if server == "" {
		return nil
	}
	older, err := Less(server, required)
	if err != nil || !older {
		return nil
	}
	return &txoutbox.ServerVersionError{Component: component, Feature: feature, Server: server, Required: required}
}

// Less reports whether version a is older than version b, both of the form
// MAJOR.MINOR.PATCH with an optional leading v, -pre-release and +build (semantic versioning:
// a pre-release is older than its release, 2.10.0-RC.1 < 2.10.0).
func Less(a, b string) (bool, error) {
	va, err := parse(a)
	if err != nil {
		return false, err
	}
	vb, err := parse(b)
	if err != nil {
		return false, err
	}
	for i := range 3 {
		if va.n[i] != vb.n[i] {
			return va.n[i] < vb.n[i], nil
		}
	}
	return prereleaseLess(va.pre, vb.pre), nil
}

type version struct {
	n   [3]int
	pre string
}

func parse(s string) (version, error) {
	var v version
	s = strings.TrimPrefix(strings.TrimSpace(s), "v")
	if i := strings.IndexByte(s, '+'); i >= 0 {
		s = s[:i]
	}
	if i := strings.IndexByte(s, '-'); i >= 0 {
		s, v.pre = s[:i], s[i+1:]
	}
	parts := strings.Split(s, ".")
	if len(parts) != 3 {
		return v, fmt.Errorf("natsver: %q is not MAJOR.MINOR.PATCH", s)
	}
	for i, p := range parts {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return v, fmt.Errorf("natsver: %q is not MAJOR.MINOR.PATCH", s)
		}
		v.n[i] = n
	}
	return v, nil
}

// prereleaseLess orders pre-release strings as semantic versioning does: none is the highest;
// dot-separated identifiers compare numerically when both are numbers, else as text; a
// shorter list of equal identifiers is older.
func prereleaseLess(a, b string) bool {
	switch {
	case a == b:
		return false
	case a == "":
		return false
	case b == "":
		return true
	}
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(as) && i < len(bs); i++ {
		if as[i] == bs[i] {
			continue
		}
		an, aerr := strconv.Atoi(as[i])
		bn, berr := strconv.Atoi(bs[i])
		switch {
		case aerr == nil && berr == nil:
			return an < bn
		case aerr == nil:
			return true // numbers sort before text
		case berr == nil:
			return false
		}
		return as[i] < bs[i]
	}
	return len(as) < len(bs)
}
