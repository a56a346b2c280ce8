package outbox

// Delayed messages: Message.DeliverAt, CancelTx, RescheduleTx.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/dbhandle"
	"github.com/txoutbox/txoutbox/internal/store"
)

// Bounds of Message.DeliverAt and of RescheduleTx's time: PostgreSQL stores far wider, but a
// time outside them is a bug (an uninitialised or mis-scaled value), not a plan. They are
// whole seconds, so a time within them stays within them when it is rounded up to the
// microsecond (see Message.DeliverAt): MaxDeliverAt less a nanosecond is stored as
// MaxDeliverAt.
var (
	MinDeliverAt = time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC)
	MaxDeliverAt = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)
)

// ErrInvalidDeliverAt: a delivery time outside MinDeliverAt..MaxDeliverAt (EnqueueTx and
// Prepare return it in a *MessageError; RescheduleTx and RescheduleBizKeyTx, and their
// database/sql twins, wrapped). Nothing is stored.
var ErrInvalidDeliverAt = errors.New("invalid delivery time")

// ErrNotScheduled is returned (in a *ScheduleError) by CancelTx and RescheduleTx (and their
// database/sql twins CancelSQLTx and RescheduleSQLTx) when the message is not, or no longer,
// waiting for its delivery time: it fell due and the relay took it (it is ready, published or
// dead: it goes, or went, out), it was cancelled (rolled_back), it is a half message not yet
// committed (settle it with Rollback instead), or it does not exist (the error then also
// matches ErrNotFound: it never existed, or it was published and deleted — with the default
// published retention of 0 a published row is deleted at once — or purged). By CancelBizKeyTx
// and RescheduleBizKeyTx (CancelBizKeySQLTx, RescheduleBizKeySQLTx) when no scheduled message
// has the business key, with the state of the key's latest message in another state (ready:
// the reminder goes out), or, when there is none, also matching ErrNotFound under the same
// rule. Nothing was changed.
var ErrNotScheduled = errors.New("message is not scheduled")

// ScheduleError says why a delayed message could not be cancelled or rescheduled.
type ScheduleError struct {
	// Op is "cancel" or "reschedule".
	Op string
	// ID is the message id, for the id forms (uuid.Nil for the business key forms; the id
	// forms given uuid.Nil report it as it was given).
	ID uuid.UUID
	// BizKey is the business key, for the business key forms (never empty: they refuse an
	// empty key); "" for the id forms. It tells the two forms apart.
	BizKey string
	// State is the message's state: "ready" (due, being published), "published" (kept by a
	// retention), "dead", "prepared", "check_exhausted", "rolled_back" (cancelled, or a half
	// message rolled back), or "" when there is no such message (never enqueued, or published
	// and deleted, or purged: ErrNotFound). For the business key forms, the state of the
	// latest message of the key (none being scheduled), or "" when there is none.
	State string
}

func (e *ScheduleError) Error() string {
	byKey := e.BizKey != ""
	what := "message " + e.ID.String()
	if byKey {
		what = fmt.Sprintf("messages of business key %q", e.BizKey)
	}
	switch {
	case byKey && e.State == "":
		return fmt.Sprintf("outbox: %s %s: none is scheduled: %v: %v (never enqueued, or published and deleted, or purged)", e.Op, what, ErrNotScheduled, ErrNotFound)
	case byKey && (e.State == store.StateReady || e.State == store.StatePublished):
		return fmt.Sprintf("outbox: %s %s: none is scheduled, the latest is %s (it fell due and is published, or being published): %v", e.Op, what, e.State, ErrNotScheduled)
	case byKey:
		return fmt.Sprintf("outbox: %s %s: none is scheduled, the latest is %s: %v", e.Op, what, e.State, ErrNotScheduled)
	case e.State == "":
		return fmt.Sprintf("outbox: %s %s: %v: %v", e.Op, what, ErrNotScheduled, ErrNotFound)
	case e.State == store.StateReady || e.State == store.StatePublished:
		return fmt.Sprintf("outbox: %s %s: it is %s (it fell due and is published, or being published): %v", e.Op, what, e.State, ErrNotScheduled)
	}
	return fmt.Sprintf("outbox: %s %s: it is %s: %v", e.Op, what, e.State, ErrNotScheduled)
}

// Unwrap returns ErrNotScheduled, and ErrNotFound as well when there is no such message (for
// the business key forms: no message of the key in any state).
func (e *ScheduleError) Unwrap() []error {
	if e.State == "" {
		return []error{ErrNotScheduled, ErrNotFound}
	}
	return []error{ErrNotScheduled}
}

// CancelTx withdraws the delayed message id inside the caller's transaction tx: if tx
// commits, the message is never published (its row is rolled_back, settled by "cancel", and
// purged with the rolled-back rows); if tx rolls back, it stays scheduled. It never begins,
// commits or rolls back tx.
//
// It succeeds only while the message is scheduled, and then holds its row lock until tx ends.
// Otherwise it returns a *ScheduleError wrapping ErrNotScheduled: most usefully, the message
// fell due and the relay took it, so it is, or is about to be, published — the reminder went
// out and the caller must live with it (typically: the consumer's handler checks the business
// state, so a timeout for an order paid meanwhile does nothing). The relay takes a due message
// in a statement that skips rows locked by a cancel in progress, and a cancel that meets a
// relay taking the row waits for it and then reports it too late: a cancel that commits always
// means the message is never published.
//
// With tx in REPEATABLE READ or SERIALIZABLE isolation, a cancel that meets a concurrent
// promotion fails with a serialization error (SQLSTATE 40001) instead: retry the transaction.
func (c *Client) CancelTx(ctx context.Context, tx txoutbox.DBTX, id uuid.UUID) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a pgx.Tx)", tx); err != nil {
		return err
	}
	ok, state, err := c.q.CancelScheduled(ctx, tx, id)
	return c.scheduleResult("cancel", id, ok, state, err)
}

// RescheduleTx moves the delivery time of the delayed message id to at, inside the caller's
// transaction tx, under the same rules as CancelTx. A time already past makes the message due
// at once (the relay takes it at its next pass). at must lie between MinDeliverAt and
// MaxDeliverAt (else an error wrapping ErrInvalidDeliverAt, and nothing changes); it is stored
// rounded up to the microsecond, as Message.DeliverAt. The message
// keeps its id and its business key: a business key that names the due time still names the
// old one, so find the message later by id or by that original key (CancelBizKeyTx with a key
// built from the new time finds nothing). To re-arm a timer for a new time as a distinct
// business event, cancel it and enqueue a new message with a key naming the new time, in one
// transaction. Its place in its key's order is still decided when it falls due.
func (c *Client) RescheduleTx(ctx context.Context, tx txoutbox.DBTX, id uuid.UUID, at time.Time) error {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a pgx.Tx)", tx); err != nil {
		return err
	}
	return c.reschedule(id, at, func(at time.Time) (bool, string, error) { return c.q.RescheduleScheduled(ctx, tx, id, at) })
}

// reschedule checks at and runs move (the pgx or the database/sql statement) with at as it is
// stored (deliverTime).
func (c *Client) reschedule(id uuid.UUID, at time.Time, move func(time.Time) (bool, string, error)) error {
	at, err := deliverTime(at)
	if err != nil {
		return fmt.Errorf("outbox: reschedule message %s: %w", id, err)
	}
	ok, state, err := move(at)
	return c.scheduleResult("reschedule", id, ok, state, err)
}

func (c *Client) scheduleResult(op string, id uuid.UUID, ok bool, state string, err error) error {
	switch {
	case errors.Is(err, store.ErrNoRow):
		return &ScheduleError{Op: op, ID: id}
	case err != nil:
		return fmt.Errorf("outbox: %s message %s: %w", op, id, err)
	case !ok:
		return &ScheduleError{Op: op, ID: id, State: state}
	}
	return nil
}

// CancelBizKeyTx withdraws, inside the caller's transaction tx, every scheduled message whose
// BizKey is bizKey, and returns their ids. When there is none it returns a *ScheduleError
// wrapping ErrNotScheduled whose State is that of the key's latest message (ready or
// published: the reminder went out; rolled_back: cancelled before; dead, prepared,
// check_exhausted), or, when the key has no message at all, wrapping ErrNotFound as well (it
// never existed, or was published and deleted — retention 0, the default — or purged). That
// lookup reads the outbox's rows (the business key index covers the scheduled rows only), and
// runs only when nothing was scheduled under the key. The rules of
// CancelTx apply to each message. A business key of delayed work should name the due time (see
// BizKey); CancelBizKeyTx then cancels one timer of an entity, not all of them. An empty or
// invalid bizKey is refused with an error wrapping ErrInvalidKey.
func (c *Client) CancelBizKeyTx(ctx context.Context, tx txoutbox.DBTX, bizKey string) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a pgx.Tx)", tx); err != nil {
		return nil, err
	}
	return cancelBizKey(bizKey, func() ([]uuid.UUID, error) { return c.q.CancelScheduledBizKey(ctx, tx, bizKey) },
		func() (string, error) { return c.q.ScheduledBizKeyState(ctx, tx, bizKey) })
}

// cancelBizKey checks bizKey and runs cancel (the pgx or the database/sql statement), then,
// when it changed nothing, state (the key's latest message not scheduled).
func cancelBizKey(bizKey string, cancel func() ([]uuid.UUID, error), state func() (string, error)) ([]uuid.UUID, error) {
	if what := checkBizKeyArg(bizKey); what != "" {
		return nil, fmt.Errorf("outbox: cancel: %w: BizKey %s", ErrInvalidKey, what)
	}
	ids, err := cancel()
	if err != nil {
		return nil, fmt.Errorf("outbox: cancel business key %q: %w", bizKey, err)
	}
	if len(ids) == 0 {
		return nil, bizKeyNotScheduled("cancel", bizKey, state)
	}
	return ids, nil
}

// bizKeyNotScheduled is the error of a business key form that changed nothing: a
// *ScheduleError with the state of the key's latest message, or the lookup's error.
func bizKeyNotScheduled(op, bizKey string, state func() (string, error)) error {
	st, err := state()
	if err != nil && !errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("outbox: %s business key %q: nothing scheduled; its state: %w", op, bizKey, err)
	}
	return &ScheduleError{Op: op, BizKey: bizKey, State: st}
}

// RescheduleBizKeyTx moves to at, inside the caller's transaction tx, the delivery time of
// every scheduled message whose BizKey is bizKey, and returns their ids; as CancelBizKeyTx
// and RescheduleTx. The messages keep their business key, bizKey, whatever time it names.
func (c *Client) RescheduleBizKeyTx(ctx context.Context, tx txoutbox.DBTX, bizKey string, at time.Time) ([]uuid.UUID, error) {
	if err := dbhandle.RequireArg("outbox", "tx", "the caller's transaction (a pgx.Tx)", tx); err != nil {
		return nil, err
	}
	return rescheduleBizKey(bizKey, at, func(at time.Time) ([]uuid.UUID, error) { return c.q.RescheduleScheduledBizKey(ctx, tx, bizKey, at) },
		func() (string, error) { return c.q.ScheduledBizKeyState(ctx, tx, bizKey) })
}

// rescheduleBizKey checks bizKey and at and runs move (the pgx or the database/sql
// statement) with at as it is stored (deliverTime), then, when it changed nothing, state.
func rescheduleBizKey(bizKey string, at time.Time, move func(time.Time) ([]uuid.UUID, error), state func() (string, error)) ([]uuid.UUID, error) {
	if what := checkBizKeyArg(bizKey); what != "" {
		return nil, fmt.Errorf("outbox: reschedule: %w: BizKey %s", ErrInvalidKey, what)
	}
	at, err := deliverTime(at)
	if err != nil {
		return nil, fmt.Errorf("outbox: reschedule business key %q: %w", bizKey, err)
	}
	ids, err := move(at)
	if err != nil {
		return nil, fmt.Errorf("outbox: reschedule business key %q: %w", bizKey, err)
	}
	if len(ids) == 0 {
		return nil, bizKeyNotScheduled("reschedule", bizKey, state)
	}
	return ids, nil
}

// checkBizKeyArg is checkKey for the business key that names the messages to cancel or
// reschedule, which must be given: an empty one names no message and is refused.
func checkBizKeyArg(bizKey string) string {
	if bizKey == "" {
		return "is empty: pass the business key of the scheduled messages"
	}
	return checkKey(bizKey)
}

// deliverTime refuses a delivery time outside the bounds, and returns one within them as it
// is stored (ceilMicrosecond).
func deliverTime(at time.Time) (time.Time, error) {
	if detail := deliverAtProblem(at); detail != "" {
		return time.Time{}, fmt.Errorf("%w: %s", ErrInvalidDeliverAt, detail)
	}
	return ceilMicrosecond(at), nil
}

// ceilMicrosecond rounds at up to the microsecond, PostgreSQL's precision: never earlier than
// at, so that a message is never due before the time it was given (pgx and the database/sql
// path would otherwise send it truncated, up to 999 ns early). The bounds are whole seconds:
// a time within them stays within them.
func ceilMicrosecond(at time.Time) time.Time {
	down := at.Truncate(time.Microsecond) // also drops a monotonic clock reading
	if down.Before(at) {
		return down.Add(time.Microsecond)
	}
	return down
}

// deliverAtProblem says what deliverTime refuses in at, or "" when at is valid: the detail
// of the error, for callers that report it in an error of their own (a *MessageError).
func deliverAtProblem(at time.Time) string {
	if at.Before(MinDeliverAt) || at.After(MaxDeliverAt) {
		return fmt.Sprintf("%s is outside %s..%s", at.Format(time.RFC3339Nano),
			MinDeliverAt.Format(time.RFC3339), MaxDeliverAt.Format(time.RFC3339))
	}
	return ""
}
