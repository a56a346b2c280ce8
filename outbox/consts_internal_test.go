package outbox

import (
	"testing"

	"github.com/txoutbox/txoutbox/internal/store"
)

// The documented limits are the ones the queries apply.
func TestDocumentedKeyLockLimitsAreTheStores(t *testing.T) {
	if KeyLockBudget != store.KeyLockBudget || KeyLockBuckets != store.KeyLockBuckets {
		t.Fatalf("outbox says %d keys and %d buckets, the store applies %d and %d",
			KeyLockBudget, KeyLockBuckets, store.KeyLockBudget, store.KeyLockBuckets)
	}
}
