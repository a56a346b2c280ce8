package relay

import (
	"testing"

	"github.com/txoutbox/txoutbox/internal/store"
)

// The documented limit is the one the queries apply.
func TestLastErrorMaxBytesIsTheStores(t *testing.T) {
	if LastErrorMaxBytes != store.MaxErrorText {
		t.Fatalf("LastErrorMaxBytes is %d, the store cuts at %d", LastErrorMaxBytes, store.MaxErrorText)
	}
}

// errStreamUnavailable's documentation states the grace in words: "three publish waves".
func TestStreamUnavailableStatesTheGrace(t *testing.T) {
	if leaderGraceWaves != 3 {
		t.Fatalf("leaderGraceWaves is %d; errStreamUnavailable's doc says three publish waves", leaderGraceWaves)
	}
}
