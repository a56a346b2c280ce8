//go:build txoutbox_fault

package fault_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/txoutbox/txoutbox/internal/fault"
)

// killChildEnv makes the test binary arm a point with the default action and pass it.
const killChildEnv = "TXOUTBOX_FAULT_TEST_KILL"

func TestMain(m *testing.M) {
	if os.Getenv(killChildEnv) == "1" {
		if err := fault.ArmSpec(fault.ConsumerAfterCommit, nil); err != nil {
			os.Exit(3)
		}
		fault.Point(fault.RelayBeforeSettle) // not armed: returns
		fault.Point(fault.ConsumerAfterCommit)
		os.Exit(0) // not reached
	}
	os.Exit(m.Run())
}

// One test, sequential inside: the points are process-wide.
func TestPoints(t *testing.T) {
	t.Parallel()
	fired := map[string]int{}
	count := func(p string) { fired[p]++ }

	t.Run("unarmed points do nothing", func(t *testing.T) {
		fault.Reset()
		fault.Point(fault.RelayBeforeSettle)
		if fault.Hits(fault.RelayBeforeSettle) != 0 {
			t.Fatal("an unarmed point counted a hit")
		}
	})
	t.Run("probability one always fires, in the caller", func(t *testing.T) {
		fault.Reset()
		clear(fired)
		if err := fault.Arm(fault.RelayBeforeSettle, 1, count); err != nil {
			t.Fatal(err)
		}
		for range 10 {
			fault.Point(fault.RelayBeforeSettle)
			fault.Point(fault.ConsumerAfterCommit) // not armed
		}
		if fired[fault.RelayBeforeSettle] != 10 || fired[fault.ConsumerAfterCommit] != 0 || fault.Hits(fault.RelayBeforeSettle) != 10 {
			t.Fatalf("fired %v, hits %d", fired, fault.Hits(fault.RelayBeforeSettle))
		}
		fault.Disarm(fault.RelayBeforeSettle)
		fault.Point(fault.RelayBeforeSettle)
		if fired[fault.RelayBeforeSettle] != 10 {
			t.Fatal("a disarmed point fired")
		}
	})
	t.Run("a probability fires about that often", func(t *testing.T) {
		fault.Reset()
		if err := fault.ArmSpec(" consumer.after-commit = 0.25 ", func(string) {}); err != nil {
			t.Fatal(err)
		}
		for range 20000 {
			fault.Point(fault.ConsumerAfterCommit)
		}
		// 5000 expected; the standard deviation is about 61.
		if h := fault.Hits(fault.ConsumerAfterCommit); h < 4500 || h > 5500 {
			t.Fatalf("fired %d times in 20000 at 0.25", h)
		}
	})
	t.Run("specifications", func(t *testing.T) {
		fault.Reset()
		got, err := fault.ParseSpec("relay.before-settle=0.02,consumer.after-commit")
		if err != nil || got[fault.RelayBeforeSettle] != 0.02 || got[fault.ConsumerAfterCommit] != 1 || len(got) != 2 {
			t.Fatalf("got %v, %v", got, err)
		}
		if got, err := fault.ParseSpec(""); err != nil || len(got) != 0 {
			t.Fatalf("empty: %v, %v", got, err)
		}
		for spec, want := range map[string]error{
			"relay.after-settle=0.5":  fault.ErrUnknownPoint,
			"relay.before-settle=0":   fault.ErrBadSpec,
			"relay.before-settle=1.5": fault.ErrBadSpec,
			"relay.before-settle=x":   fault.ErrBadSpec,
		} {
			if _, err := fault.ParseSpec(spec); !errors.Is(err, want) {
				t.Errorf("%q: %v, want %v", spec, err, want)
			}
		}
		if err := fault.ArmSpec("relay.before-settle=0.5,nope", nil); !errors.Is(err, fault.ErrUnknownPoint) {
			t.Fatalf("ArmSpec: %v", err)
		}
		fault.Point(fault.RelayBeforeSettle) // nothing was armed: must not kill the test
		if err := fault.Arm("nope", 1, nil); !errors.Is(err, fault.ErrUnknownPoint) {
			t.Fatalf("Arm: %v", err)
		}
		if len(fault.Points()) != 2 {
			t.Fatalf("points %v", fault.Points())
		}
	})
	fault.Reset()
}

// The default action kills the process with SIGKILL, after naming the point on stderr.
func TestKill(t *testing.T) {
	t.Parallel()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), killChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("the child was not killed: %v\n%s", err, out)
	}
	if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("the child ended with %v, want SIGKILL\n%s", ee, out)
	}
	if !strings.Contains(string(out), fault.KillMarker+fault.ConsumerAfterCommit) {
		t.Fatalf("stderr does not name the point:\n%s", out)
	}
}
