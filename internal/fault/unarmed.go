//go:build !txoutbox_fault

package fault

// Enabled reports whether fault injection is compiled in (the txoutbox_fault build tag).
const Enabled = false

// Point does nothing: fault injection is not compiled in.
func Point(string) {}

// Arm returns ErrNotCompiled: fault injection is not compiled in.
func Arm(name string, probability float64, action Action) error { return ErrNotCompiled }

// ArmSpec returns ErrNotCompiled for any specification that arms a point.
func ArmSpec(spec string, action Action) error {
	points, err := ParseSpec(spec)
	if err != nil {
		return err
	}
	if len(points) > 0 {
		return ErrNotCompiled
	}
	return nil
}

// Disarm does nothing: nothing can be armed.
func Disarm(string) {}

// Reset clears the hit counts.
func Reset() { hits.Clear() }
