package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// edgeCases is the class of values that would not reach a consumer as given (white space at
// an end, ASCII or Unicode; control characters), headers JetStream or nats.go treat as their
// own, and subjects that belong to NATS: each must be refused at the door, in Key, BizKey and
// header values alike.
var badTexts = map[string]string{
	"leading space":       " order-1",
	"trailing space":      "order-1 ",
	"trailing tab":        "order-1\t",
	"leading tab":         "\torder-1",
	"trailing NBSP":       "order-1\u00a0",
	"leading NBSP":        "\u00a0order-1",
	"trailing ideo space": "order-1\u3000",
	"trailing line sep":   "order-1\u2028",
	"trailing NEL":        "order-1\u0085",
	"trailing BOM":        "order-1\ufeff",
	"thin space":          "\u2009order-1",
	"only spaces":         "   ",
	"only NBSP":           "\u00a0",
	"control SOH":         "a\x01b",
	"control DEL":         "a\x7fb",
	"control C1":          "a\u0090b",
	"newline":             "a\nb",
	"carriage return":     "a\rb",
	"NUL":                 "a\x00b",
	"invalid UTF-8":       "a\xffb",
}

func TestEdgeValuesRefusedEverywhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	type tcase struct {
		name string
		msg  outbox.Message
		want error
	}
	var cases []tcase
	for name, v := range badTexts {
		cases = append(cases,
			tcase{"Key " + name, outbox.Message{Subject: "a.b", Key: v}, outbox.ErrInvalidKey},
			tcase{"BizKey " + name, outbox.Message{Subject: "a.b", BizKey: v}, outbox.ErrInvalidKey},
			tcase{"header value " + name, outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-V": {"fine", v}}}, outbox.ErrInvalidHeader},
		)
	}
	for _, name := range []string{
		"Nats-Expected-Stream", "Nats-Expected-Last-Sequence", "Nats-Expected-Last-Msg-Id", "nats-ttl", "Nats-Rollup",
		"NATS-INCR", "Nats-Batch-Id", "Nats-Schedule", "Nats-Trace-Dest", "Nats-Required-Api-Level", "Nats-Something-New",
		"Txoutbox-Dead-Reason", "txoutbox-key", "Txoutbox-Biz-Key", "Txoutbox-Future", "Status", "description", "Nats-Msg-Id",
	} {
		cases = append(cases, tcase{"reserved header " + name, outbox.Message{Subject: "a.b", Headers: map[string][]string{name: {"x"}}}, outbox.ErrInvalidHeader})
	}
	cases = append(cases,
		tcase{"header without values", outbox.Message{Subject: "a.b", Headers: map[string][]string{"X-Empty": {}}}, outbox.ErrInvalidHeader},
		tcase{"subject $JS.API", outbox.Message{Subject: "$JS.API.STREAM.DELETE.ORDERS"}, outbox.ErrInvalidSubject},
		tcase{"subject $js lower case", outbox.Message{Subject: "$js.api.INFO"}, outbox.ErrInvalidSubject},
		tcase{"subject $JS.ACK", outbox.Message{Subject: "$JS.ACK.ORDERS.c.1.1.1.1.0"}, outbox.ErrInvalidSubject},
		tcase{"subject $SYS", outbox.Message{Subject: "$SYS.REQ.SERVER.PING"}, outbox.ErrInvalidSubject},
		tcase{"subject $JSC", outbox.Message{Subject: "$JSC.CI.x"}, outbox.ErrInvalidSubject},
		tcase{"subject $NRG", outbox.Message{Subject: "$NRG.AE.x"}, outbox.ErrInvalidSubject},
	)
	for _, tc := range cases {
		for _, how := range []string{"EnqueueTx", "Prepare"} {
			var err error
			if how == "EnqueueTx" {
				err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
					_, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "a.b", Key: "fine"}, tc.msg)
					return err
				})
			} else {
				_, err = c.Prepare(ctx, db.Pool, tc.msg, &outbox.PrepareOptions{Fence: true})
			}
			var me *outbox.MessageError
			if !errors.Is(err, tc.want) || !errors.As(err, &me) {
				t.Errorf("%s via %s: err = %v, want a *MessageError wrapping %v", tc.name, how, err, tc.want)
				continue
			}
			if how == "EnqueueTx" && me.Index != 1 {
				t.Errorf("%s: the error names message %d, want 1", tc.name, me.Index)
			}
		}
	}
	if n := count(t, db, "true"); n != 0 {
		t.Fatalf("%d rows written by refused messages", n)
	}
}

// What arrives exactly is accepted: white space and tabs inside, Unicode, empty header
// values, names differing only in case, subjects under $KV and $O (JetStream's KV and object
// stores are streams a producer may write to).
func TestEdgeValuesAccepted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c := newClient(t, db, nil)
	good := []outbox.Message{
		{Subject: "a.b", Key: "order 1", BizKey: "order:1\u00a0created"},
		{Subject: "a.b", Key: "注文-1", BizKey: "ü"},
		{Subject: "a.b", Headers: map[string][]string{"X-V": {"a\tb", "", "a  b"}, "x-v": {"lower"}, "traceparent": {"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}}},
		{Subject: "a.b", Headers: map[string][]string{"X-Status": {"fine"}, "Natsy": {"fine"}, "Txoutboxy": {"fine"}}},
		{Subject: "$KV.bucket.key"},
		{Subject: "$O.store.M.x"},
		{Subject: "JS.API.not.reserved"},
		{Subject: "a.b", Key: strings.Repeat("k", outbox.MaxKeyLength)},
	}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(ctx, tx, good...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "true"); n != len(good) {
		t.Fatalf("rows = %d, want %d", n, len(good))
	}
}

// The rule is one function per kind of value, exported so that callers can check values
// before they build messages.
func TestValidateKeyAndHeaderValue(t *testing.T) {
	for name, v := range badTexts {
		if err := outbox.ValidateKey(v); !errors.Is(err, outbox.ErrInvalidKey) {
			t.Errorf("ValidateKey(%s %q) = %v", name, v, err)
		}
		if err := outbox.ValidateHeaderValue(v); !errors.Is(err, outbox.ErrInvalidHeader) {
			t.Errorf("ValidateHeaderValue(%s %q) = %v", name, v, err)
		}
	}
	if err := outbox.ValidateHeaderValue("a\tb"); err != nil {
		t.Errorf("an inner tab is carried: %v", err)
	}
	if err := outbox.ValidateKey("a\tb"); err == nil {
		t.Errorf("a tab in a key is refused: keys hold no control character")
	}
	if _, reserved := outbox.ReservedHeader("traceparent"); reserved {
		t.Errorf("traceparent is not reserved")
	}
}
