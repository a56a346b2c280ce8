//go:build txoutbox_fault

package fault

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// Enabled reports whether fault injection is compiled in (the txoutbox_fault build tag).
const Enabled = true

var (
	anyArmed atomic.Bool
	mu       sync.RWMutex
	table    = map[string]*armed{}
)

type armed struct {
	prob   float64
	action Action
}

// Point marks a fault-injection point. When name is armed it fires with the armed probability:
// it counts a hit and runs the action (Kill unless another was given), in the caller's
// goroutine, before the caller goes on.
func Point(name string) {
	if !anyArmed.Load() {
		return
	}
	mu.RLock()
	a := table[name]
	mu.RUnlock()
	if a == nil || (a.prob < 1 && rand.Float64() >= a.prob) {
		return
	}
	counter(name).Add(1)
	act := a.action
	if act == nil {
		act = Kill
	}
	act(name)
}

// Arm arms the point name with a probability in (0, 1] and an action (nil means Kill).
// Arming an armed point replaces its setting.
func Arm(name string, probability float64, action Action) error {
	if !slices.Contains(known, name) {
		return fmt.Errorf("%w %q (known: %s)", ErrUnknownPoint, name, strings.Join(known, ", "))
	}
	if !(probability > 0 && probability <= 1) {
		return fmt.Errorf("%w: probability of %q must be in (0, 1], got %v", ErrBadSpec, name, probability)
	}
	mu.Lock()
	defer mu.Unlock()
	table[name] = &armed{prob: probability, action: action}
	anyArmed.Store(true)
	return nil
}

// ArmSpec arms every point of a specification (see ParseSpec) with action (nil means Kill).
// Nothing is armed when the specification is invalid.
func ArmSpec(spec string, action Action) error {
	points, err := ParseSpec(spec)
	if err != nil {
		return err
	}
	for name, p := range points {
		if err := Arm(name, p, action); err != nil {
			return err
		}
	}
	return nil
}

// Disarm disarms one point.
func Disarm(name string) {
	mu.Lock()
	defer mu.Unlock()
	delete(table, name)
	anyArmed.Store(len(table) > 0)
}

// Reset disarms every point and clears the hit counts.
func Reset() {
	mu.Lock()
	defer mu.Unlock()
	clear(table)
	anyArmed.Store(false)
	hits.Clear()
}

// Kill writes KillMarker and the point's name to stderr, then kills the process with SIGKILL
// (no deferred calls, no graceful shutdown: a crash). It does not return. It exists only in
// builds with the txoutbox_fault tag.
func Kill(point string) {
	fmt.Fprintf(os.Stderr, "%s%s\n", KillMarker, point)
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill()
	}
	select {} // the signal is on its way; never let the caller go on
}
