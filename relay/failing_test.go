package relay

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/store"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// The first failure on a subject is logged at WARN saying what happens to the message: a
// message that is not retried (its attempts ran out: --max-attempts 1, say) was announced as
// "retried with backoff", beside will_retry=false.
func TestFirstFailureOfASubjectSaysWhetherItIsRetried(t *testing.T) {
	t.Parallel()
	for _, retry := range []bool{true, false} {
		logs := &testsvc.LogBuffer{}
		log := slog.New(slog.NewTextHandler(logs, nil))
		var f failingSubjects
		row := &store.Claimed{MessageID: uuid.New(), Subject: "orders.created"}
		f.failed(log, row, "boom", retry)
		f.failed(log, row, "boom", retry) // logged at debug level: not shown
		out := logs.String()
		if n := strings.Count(out, "level=WARN"); n != 1 {
			t.Fatalf("will_retry=%v: %d warnings, want 1:\n%s", retry, n, out)
		}
		says := strings.Contains(out, "this message is not retried (it becomes dead)")
		if says == retry {
			t.Errorf("will_retry=%v: the warning says %q", retry, out)
		}
	}
}
