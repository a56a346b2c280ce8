// Package testsignal lets a component tell tests that something happened (river's testsignal
// pattern). A component holds a Signal per event as an unexported field; it is nil-channelled
// in production, where Signal is a nil check and nothing else, and a test initialises it
// through an unexported hook (in an export_test.go or the package's own tests) and waits on
// C.
package testsignal

// bufferSize is how many events a test may leave unread before later ones are dropped.
const bufferSize = 256

// Signal is one kind of event of a component.
type Signal[T any] struct {
	ch chan T
}

// Init makes the signal deliver events; tests call it before the component starts.
func (s *Signal[T]) Init() { s.ch = make(chan T, bufferSize) }

// Signal reports v to a test waiting on C; it never blocks (a full buffer drops v), and does
// nothing unless Init was called.
func (s *Signal[T]) Signal(v T) {
	if s.ch == nil {
		return
	}
	select {
	case s.ch <- v:
	default:
	}
}

// C is where the events arrive (nil before Init).
func (s *Signal[T]) C() <-chan T { return s.ch }
