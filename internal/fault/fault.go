// Package fault holds txoutbox's named fault-injection points, for the crash tests and the
// chaos run. A point is a call, Point(name), placed at a moment where a crash matters (between
// a relay's publish and its settle, between a consumer's commit and its ack). Unarmed, it costs
// one atomic load. Armed with a probability, it runs its action at that moment with that
// probability; the default action kills the process with SIGKILL, as a crash or an OOM kill
// would, after writing KillMarker and the point's name to stderr so that a supervisor can tell
// an injected death from any other.
//
// Points are armed by the programs that want them (`relay run --fault`), never by this package
// on its own, and only in binaries built with the build tag txoutbox_fault (the crash tests
// and the chaos proof build the relay so). Without it, which is how every production binary is
// built, Point compiles to nothing, Arm returns ErrNotCompiled and Kill does not exist (it is
// only in the tagged build): no flag, environment variable or input can make a production
// process kill itself. A program that reads a specification (a flag, EnvVar) does so only
// when Enabled, so that a production build has neither.
package fault

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// EnvVar is the environment variable programs read a fault specification from (see ParseSpec).
const EnvVar = "TXOUTBOX_FAULTS"

// The points compiled into txoutbox.
const (
	// RelayBeforeSettle: every PubAck of a relay batch is in (its messages are stored in the
	// stream), and the batch is not settled yet (its rows are still ready in the outbox).
	RelayBeforeSettle = "relay.before-settle"
	// ConsumerAfterCommit: a consumer transaction (dedup row and business effect) committed,
	// and its messages are not acked yet. The consumer package has no point of its own: the
	// demo's consumer role fires it from the database handle it gives the consumer.
	ConsumerAfterCommit = "consumer.after-commit"
)

// KillMarker starts the line Kill writes to stderr before it kills the process; the point's
// name follows.
const KillMarker = "txoutbox fault: killing the process (SIGKILL) at "

// Sentinel errors of Arm and ParseSpec.
var (
	// ErrUnknownPoint: no point of that name exists (see Points).
	ErrUnknownPoint = errors.New("fault: unknown point")
	// ErrBadSpec: a specification that is not name=probability[,name=probability...] with
	// probabilities in (0, 1].
	ErrBadSpec = errors.New("fault: invalid specification")
	// ErrNotCompiled: Arm in a binary built without the txoutbox_fault build tag.
	ErrNotCompiled = errors.New("fault: fault injection is not compiled in (build with -tags txoutbox_fault)")
)

var known = []string{RelayBeforeSettle, ConsumerAfterCommit}

// Points returns the names of the points compiled into txoutbox.
func Points() []string { return slices.Clone(known) }

var hits sync.Map // name -> *atomic.Int64

// Action is what an armed point does when it fires.
type Action func(point string)

// ParseSpec parses "name=probability[,name=probability...]", for example
// "relay.before-settle=0.02". A name without "=probability" means probability 1. Spaces
// around items are ignored; an empty specification arms nothing.
func ParseSpec(spec string) (map[string]float64, error) {
	out := map[string]float64{}
	for _, item := range strings.Split(spec, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, ps, hasP := strings.Cut(item, "=")
		name = strings.TrimSpace(name)
		p := 1.0
		if hasP {
			var err error
			if p, err = strconv.ParseFloat(strings.TrimSpace(ps), 64); err != nil {
				return nil, fmt.Errorf("%w: %q: probability %q is not a number", ErrBadSpec, item, ps)
			}
		}
		if !slices.Contains(known, name) {
			return nil, fmt.Errorf("%w %q (known: %s)", ErrUnknownPoint, name, strings.Join(known, ", "))
		}
		if !(p > 0 && p <= 1) {
			return nil, fmt.Errorf("%w: probability of %q must be in (0, 1], got %v", ErrBadSpec, name, p)
		}
		out[name] = p
	}
	return out, nil
}

// Hits returns how many times the point fired since the last Reset.
func Hits(name string) int64 { return counter(name).Load() }

func counter(name string) *atomic.Int64 {
	c, _ := hits.LoadOrStore(name, new(atomic.Int64))
	return c.(*atomic.Int64)
}
