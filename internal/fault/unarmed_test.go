//go:build !txoutbox_fault

package fault_test

import (
	"errors"
	"testing"

	"github.com/txoutbox/txoutbox/internal/fault"
)

// Built without the txoutbox_fault tag, as production binaries are, nothing can be armed.
func TestNothingCanBeArmedWithoutTheBuildTag(t *testing.T) {
	if fault.Enabled {
		t.Fatal("Enabled without the build tag")
	}
	if err := fault.Arm(fault.RelayBeforeSettle, 1, nil); !errors.Is(err, fault.ErrNotCompiled) {
		t.Fatalf("Arm: %v, want ErrNotCompiled", err)
	}
	if err := fault.ArmSpec(fault.ConsumerAfterCommit+"=1", nil); !errors.Is(err, fault.ErrNotCompiled) {
		t.Fatalf("ArmSpec: %v, want ErrNotCompiled", err)
	}
	if err := fault.ArmSpec("", nil); err != nil {
		t.Fatalf("an empty specification: %v", err)
	}
	if err := fault.ArmSpec("nope=1", nil); !errors.Is(err, fault.ErrUnknownPoint) {
		t.Fatalf("a bad specification: %v, want ErrUnknownPoint", err)
	}
	fault.Point(fault.RelayBeforeSettle) // must return
	if fault.Hits(fault.RelayBeforeSettle) != 0 {
		t.Fatal("a point counted a hit")
	}
}
