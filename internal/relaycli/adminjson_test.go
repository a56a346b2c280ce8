package relaycli

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

var snakeCase = regexp.MustCompile(`^[a-z][a-z0-9]*(_[a-z0-9]+)*$`)

// checkJSONConvention fails unless doc is one JSON document whose object keys are all
// snake_case (the contents of "headers", which are data, excepted) and that has no null list:
// an empty list is [].
func checkJSONConvention(t *testing.T, what, doc string) any {
	t.Helper()
	var v any
	dec := json.NewDecoder(strings.NewReader(doc))
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("%s is not JSON: %v\n%s", what, err, doc)
	}
	if dec.More() {
		t.Fatalf("%s is more than one JSON document:\n%s", what, doc)
	}
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				if !snakeCase.MatchString(k) {
					t.Errorf("%s: key %s.%s is not snake_case", what, path, k)
				}
				if k == "headers" {
					continue
				}
				walk(path+"."+k, e)
			}
		case []any:
			for i, e := range x {
				walk(path+"["+strconv.Itoa(i)+"]", e)
			}
		}
	}
	walk("", v)
	return v
}

// One JSON convention for the admin commands: relay status --json is an object, relay dead
// list --json and relay prepared list --json are arrays ([] when empty), snake_case keys,
// lists never null.
func TestAdminJSONConvention(t *testing.T) {
	t.Parallel()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}

	// An empty outbox.
	for _, c := range []struct {
		args []string
		want string // the whole output, for the empty lists
	}{
		{[]string{"dead", "list", "--json"}, "[]\n"},
		{[]string{"prepared", "list", "--json"}, "[]\n"},
	} {
		code, out, errOut := cliEnv(t, vars, c.args...)
		if code != 0 || out != c.want {
			t.Errorf("%v on an empty outbox: exit %d, %q (want %q) %s", c.args, code, out, c.want, errOut)
		}
	}
	code, out, errOut := cliEnv(t, vars, "status", "--json")
	if code != 0 {
		t.Fatalf("status --json: exit %d: %s", code, errOut)
	}
	st, ok := checkJSONConvention(t, "status --json", out).(map[string]any)
	if !ok {
		t.Fatalf("status --json is not an object:\n%s", out)
	}
	for _, k := range []string{"subjects", "relays", "panels", "problems", "partition_table"} {
		if l, ok := st[k].([]any); !ok || (k != "partition_table" && k != "panels" && len(l) != 0) {
			t.Errorf("status --json: %s = %v, want a list (empty on an empty outbox)", k, st[k])
		}
	}

	// With a dead row and a half message.
	ctx := context.Background()
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var dead []uuid.UUID
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		dead, err = c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.paid", Key: "o1", Payload: []byte("{}"),
			Headers: map[string][]string{"Content-Type": {"application/json"}}})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', last_error = 'x' WHERE message_id = $1`, dead[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"}); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{{"dead", "list", "--json"}, {"prepared", "list", "--json"}} {
		code, out, errOut := cliEnv(t, vars, args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", args, code, errOut)
		}
		l, ok := checkJSONConvention(t, strings.Join(args, " "), out).([]any)
		if !ok || len(l) != 1 {
			t.Fatalf("%v is not an array of one row:\n%s", args, out)
		}
		row := l[0].(map[string]any)
		for _, k := range []string{"message_id", "state", "subject", "key", "created_at", "last_error"} {
			if _, ok := row[k]; !ok {
				t.Errorf("%v: a row lacks %q (every field is present):\n%s", args, k, out)
			}
		}
	}
	code, out, _ = cliEnv(t, vars, "status", "--json")
	if code != 0 {
		t.Fatal(out)
	}
	checkJSONConvention(t, "status --json", out)
}

// What to select or change is never read from the environment by relay dead, relay prepared
// and relay scheduled: only --database-url and --schema are; and a stray TXOUTBOX_ALL=true (or
// any other selection variable) does not make relay prepared resume resume anything.
func TestAdminSelectionIsCommandLineOnly(t *testing.T) {
	t.Parallel()
	for _, cmd := range []string{"dead", "prepared", "scheduled"} {
		code, out, _ := cliEnv(t, nil, cmd, "--help")
		if code != 0 {
			t.Fatalf("%s --help: exit %d", cmd, code)
		}
		// The settings table, not the usage text above it (which may start a line with a flag).
		_, table, ok := strings.Cut(out, "Settings (flag, environment variable, default):")
		if !ok {
			t.Fatalf("%s --help has no settings table:\n%s", cmd, out)
		}
		lines := strings.Split(table, "\n")
		n := 0
		for i, l := range lines {
			f := strings.Fields(l)
			if len(f) == 0 || !strings.HasPrefix(f[0], "--") || i+1 == len(lines) {
				continue
			}
			n++
			name, next := f[0][2:], lines[i+1]
			fromEnv := strings.Contains(next, " env ")
			if want := name == "database-url" || name == "schema"; fromEnv != want {
				t.Errorf("relay %s --%s: read from the environment %v, want %v (%s)", cmd, name, fromEnv, want, strings.TrimSpace(next))
			}
		}
		if n < 5 {
			t.Fatalf("relay %s --help lists %d settings:\n%s", cmd, n, out)
		}
	}

	ctx := context.Background()
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created"}, &outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted' WHERE message_id = $1`, h.ID); err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema, "NATS_URL": n.URL(),
		"TXOUTBOX_ALL": "true", "TXOUTBOX_GROUP": "orders", "TXOUTBOX_STATE": "all", "TXOUTBOX_ID": h.ID.String(),
		"TXOUTBOX_SUBJECT": ">", "TXOUTBOX_OLDER_THAN": "1ns", "TXOUTBOX_LIMIT": "1000"}
	for _, args := range [][]string{{"prepared", "resume"}, {"prepared", "commit"}, {"prepared", "rollback"}} {
		if code, out, errOut := cliEnv(t, vars, args...); code != 2 {
			t.Errorf("%v with the selection only in the environment: exit %d, want 2 (usage):\n%s%s", args, code, out, errOut)
		}
	}
	var state string
	if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, h.ID).Scan(&state); err != nil || state != "check_exhausted" {
		t.Fatalf("the half message is %s (%v) after commands whose selection came from the environment", state, err)
	}
	// The same command with --all typed resumes it.
	if code, out, errOut := cliEnv(t, vars, "prepared", "resume", "--all"); code != 0 || !strings.Contains(out, "resumed "+h.ID.String()) {
		t.Fatalf("prepared resume --all: exit %d: %s%s", code, out, errOut)
	}
}

// A stray selection variable (TXOUTBOX_BIZ_KEY, TXOUTBOX_ID, TXOUTBOX_ALL, ...) never widens
// relay scheduled cancel: without a typed selection it is a usage error (exit 2), and with one
// it cancels exactly what was typed; the message the environment names stays scheduled until
// its business key is typed.
func TestScheduledCancelSelectionIsCommandLineOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	var due time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT now() + interval '1 hour'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	var ids []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.expire", BizKey: "order:1:expire", DeliverAt: due},
			outbox.Message{Subject: "orders.expire", BizKey: "order:2:expire", DeliverAt: due},
			outbox.Message{Subject: "orders.expire", BizKey: "order:3:expire", DeliverAt: due})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	target, typedByKey, typedByID := ids[0], ids[1], ids[2]
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema,
		"TXOUTBOX_BIZ_KEY": "order:1:expire", "BIZ_KEY": "order:1:expire", "TXOUTBOX_ID": target.String(),
		"TXOUTBOX_MESSAGE_ID": target.String(), "TXOUTBOX_ALL": "true", "TXOUTBOX_SUBJECT": "orders.expire",
		"TXOUTBOX_STATE": "all", "TXOUTBOX_LIMIT": "1000"}
	state := func(id uuid.UUID) string {
		t.Helper()
		var st string
		if err := db.Pool.QueryRow(ctx, `SELECT state FROM txoutbox_messages WHERE message_id = $1`, id).Scan(&st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	if code, out, errOut := cliEnv(t, vars, "scheduled", "cancel"); code != 2 {
		t.Errorf("scheduled cancel with the selection only in the environment: exit %d, want 2 (usage):\n%s%s", code, out, errOut)
	}
	if code, out, errOut := cliEnv(t, vars, "scheduled", "cancel", "--biz-key", "order:2:expire"); code != 0 ||
		strings.Contains(out, target.String()) || !strings.Contains(out, "cancelled "+typedByKey.String()) {
		t.Errorf("scheduled cancel --biz-key order:2:expire: exit %d:\n%s%s", code, out, errOut)
	}
	if code, out, errOut := cliEnv(t, vars, "scheduled", "cancel", typedByID.String(), "--json"); code != 0 ||
		strings.Contains(out, target.String()) || !strings.Contains(out, typedByID.String()) {
		t.Errorf("scheduled cancel %s: exit %d:\n%s%s", typedByID, code, out, errOut)
	}
	if st := state(target); st != "scheduled" {
		t.Fatalf("the message named only by the environment is %s, want scheduled", st)
	}
	for _, id := range []uuid.UUID{typedByKey, typedByID} {
		if st := state(id); st != "rolled_back" {
			t.Errorf("typed message %s is %s, want rolled_back (cancelled)", id, st)
		}
	}
	// Typed, the business key the environment named is cancelled.
	if code, out, errOut := cliEnv(t, vars, "scheduled", "cancel", "--biz-key", "order:1:expire"); code != 0 || !strings.Contains(out, "cancelled "+target.String()) {
		t.Fatalf("scheduled cancel --biz-key order:1:expire: exit %d: %s%s", code, out, errOut)
	}
}

// relay dead show and relay prepared show print a row's headers, payload (text when it is
// UTF-8 text, else base64) and last error, as text or as one JSON object.
func TestShowCommands(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	binary := []byte{0xff, 0x00, 0x1b, 'x'}
	text := "{\"amount\": 12}\nsecond line"
	var ids []uuid.UUID
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(ctx, tx,
			outbox.Message{Subject: "orders.paid", Key: "order-7", Payload: []byte(text),
				Headers: map[string][]string{"Content-Type": {"application/json"}, "X-Tenant": {"acme"}}},
			outbox.Message{Subject: "orders.paid", Payload: binary},
			outbox.Message{Subject: "orders.paid", Payload: []byte("ready")},
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 20,
		last_error = 'stream ORDERS: maximum message size exceeded' WHERE message_id = ANY($1)`, ids[:2]); err != nil {
		t.Fatal(err)
	}
	half, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("charge 42")}, &outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted', check_count = 15,
		last_error = 'no_responders: nobody serves payments' WHERE message_id = $1`, half.ID); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := cliEnv(t, vars, "dead", "show", ids[0].String())
	if code != 0 {
		t.Fatalf("dead show: exit %d: %s", code, errOut)
	}
	t.Logf("relay dead show:\n%s", out)
	for _, want := range []string{"state:        dead", "subject:      orders.paid", "key:          order-7", "attempts:     20",
		"last_error:   stream ORDERS: maximum message size exceeded", "  Content-Type: application/json", "  X-Tenant: acme",
		"payload:      " + strconv.Itoa(len(text)) + " bytes, text\n" + text + "\n"} {
		if !strings.Contains(out, want) {
			t.Errorf("dead show lacks %q", want)
		}
	}
	code, out, _ = cliEnv(t, vars, "dead", "show", "--json", ids[1].String())
	var m struct {
		MessageID       uuid.UUID           `json:"message_id"`
		State           string              `json:"state"`
		Headers         map[string][]string `json:"headers"`
		Payload         string              `json:"payload"`
		PayloadEncoding string              `json:"payload_encoding"`
		PayloadBytes    int                 `json:"payload_bytes"`
		LastError       string              `json:"last_error"`
		Checks          int                 `json:"checks"`
		Group           string              `json:"group"`
	}
	checkJSONConvention(t, "dead show --json", out)
	if code != 0 || json.Unmarshal([]byte(out), &m) != nil || m.MessageID != ids[1] || m.State != "dead" || m.PayloadEncoding != "base64" ||
		m.PayloadBytes != len(binary) || m.Headers == nil || !strings.Contains(m.LastError, "maximum message size") {
		t.Fatalf("dead show --json of a binary payload: exit %d:\n%s", code, out)
	}
	if got, err := base64.StdEncoding.DecodeString(m.Payload); err != nil || string(got) != string(binary) {
		t.Errorf("base64 payload decodes to %q (%v), want %q", got, err, binary)
	}
	code, out, _ = cliEnv(t, vars, "dead", "show", ids[1].String())
	if code != 0 || !strings.Contains(out, "payload:      4 bytes, base64 (binary, or text with control characters)\n"+base64.StdEncoding.EncodeToString(binary)+"\n") {
		t.Errorf("dead show of a binary payload:\n%s", out)
	}

	code, out, _ = cliEnv(t, vars, "prepared", "show", half.ID.String(), "--json")
	m = struct {
		MessageID       uuid.UUID           `json:"message_id"`
		State           string              `json:"state"`
		Headers         map[string][]string `json:"headers"`
		Payload         string              `json:"payload"`
		PayloadEncoding string              `json:"payload_encoding"`
		PayloadBytes    int                 `json:"payload_bytes"`
		LastError       string              `json:"last_error"`
		Checks          int                 `json:"checks"`
		Group           string              `json:"group"`
	}{}
	if code != 0 || json.Unmarshal([]byte(out), &m) != nil || m.State != "check_exhausted" || m.Payload != "charge 42" ||
		m.PayloadEncoding != "text" || m.Checks != 15 || m.Group != "payments" || !strings.Contains(m.LastError, "no_responders") {
		t.Fatalf("prepared show --json: exit %d:\n%s", code, out)
	}
	code, out, _ = cliEnv(t, vars, "prepared", "show", half.ID.String())
	for _, want := range []string{"state:        check_exhausted", "group:        payments", "checks:       15", "payload:      9 bytes, text\ncharge 42\n"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("prepared show lacks %q:\n%s", want, out)
		}
	}

	// A row of another kind, or none, is an error (1); a malformed id, or none, is usage (2).
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"dead", "show", ids[2].String()}, 1, "is ready, not dead"},
		{[]string{"dead", "show", half.ID.String()}, 1, "not dead"},
		{[]string{"prepared", "show", ids[0].String()}, 1, "is dead, not prepared or check_exhausted"},
		{[]string{"dead", "show", uuid.NewString()}, 1, "no such message"},
		{[]string{"dead", "show", "not-a-uuid"}, 2, "invalid message id"},
		{[]string{"dead", "show"}, 2, "one message id"},
		{[]string{"prepared", "show", ids[0].String(), ids[1].String()}, 2, "one message id"},
		{[]string{"dead", "show", ids[0].String(), "--all"}, 2, "no filters"},
	} {
		code, out, errOut := cliEnv(t, vars, c.args...)
		if code != c.code || !strings.Contains(errOut, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want %d and %q (stdout %q)", c.args, code, errOut, c.code, c.want, out)
		}
	}
}

// The text output of relay dead show/list, prepared show/list and scheduled list writes the
// control characters of text that comes from outside (a last error, a subject, a key, a
// header, a producer group, a business key) escaped, \x1b and \n and \r as in a Go string, so
// that a stored ESC sequence cannot act on the operator's terminal and a stored newline cannot
// forge a line; the JSON output keeps them (escaped by JSON). A payload is shown as text only
// when it is UTF-8 without control characters other than tab and newline: one with an ESC or a
// CR is base64, labelled as what it may be.
func TestAdminTextEscapesControlCharacters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	const evil = "\x1b[2J\x1b[H\nFORGED row\rover\u202eevil\x00\u0085end"
	const escaped = `\x1b[2J\x1b[H\nFORGED row\rover\u202eevil\x00\u0085end`
	payloads := [][]byte{[]byte("line one\n\tline two\n"), []byte("clear\x1b[2J"), []byte("over\rwrite")}
	var ids []uuid.UUID
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		for _, p := range payloads {
			got, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.paid", Key: "k", Payload: p})
			if err != nil {
				return err
			}
			ids = append(ids, got...)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// The stored texts, written as a hostile writer of the table (or a NATS error text) could.
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 3, last_error = $2,
		subject = 'orders.' || $2, msg_key = $2, headers = jsonb_build_object($2::text, jsonb_build_array($2::text))
		WHERE message_id = ANY($1)`, ids, strings.ReplaceAll(evil, "\x00", "")); err != nil {
		t.Fatal(err)
	}
	half, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("charge")}, &outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted', last_error = $2, subject = 'payments.' || $2,
		msg_key = $2, producer_group = $2 WHERE message_id = $1`, half.ID, strings.ReplaceAll(evil, "\x00", "")); err != nil {
		t.Fatal(err)
	}
	var due time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT now() + interval '1 hour'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		sched, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.later", Payload: []byte("x"), DeliverAt: due})
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `UPDATE txoutbox_messages SET subject = 'orders.' || $2, msg_key = $2,
			headers = jsonb_build_object('Txoutbox-Biz-Key', jsonb_build_array($2::text)) WHERE message_id = ANY($1)`, sched, strings.ReplaceAll(evil, "\x00", ""))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	wantEscaped := strings.ReplaceAll(escaped, `\x00`, "")
	clean := func(what, out string) {
		t.Helper()
		for _, bad := range []string{"\x1b", "\r", "\u202e", "\u0085"} {
			if strings.Contains(out, bad) {
				t.Errorf("%s prints %q raw:\n%s", what, bad, out)
			}
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "FORGED") {
				t.Errorf("%s prints a forged line %q:\n%s", what, line, out)
			}
		}
	}
	for _, args := range [][]string{{"dead", "show", ids[0].String()}, {"prepared", "show", half.ID.String()}} {
		code, out, errOut := cliEnv(t, vars, args...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", strings.Join(args, " "), code, errOut)
		}
		clean(strings.Join(args[:2], " "), out)
		for _, want := range []string{"last_error:   " + wantEscaped + "\n", "key:          " + wantEscaped + "\n"} {
			if !strings.Contains(out, want) {
				t.Errorf("%s lacks %q:\n%s", strings.Join(args[:2], " "), want, out)
			}
		}
	}
	code, out, _ := cliEnv(t, vars, "dead", "show", ids[0].String())
	if code != 0 || !strings.Contains(out, "  "+wantEscaped+": "+wantEscaped+"\n") || !strings.Contains(out, "payload:      19 bytes, text\nline one\n\tline two\n") {
		t.Errorf("dead show: want the header escaped and the payload with a newline and a tab as text:\n%s", out)
	}
	for i, p := range payloads[1:] {
		code, out, _ := cliEnv(t, vars, "dead", "show", ids[i+1].String())
		want := fmt.Sprintf("payload:      %d bytes, base64 (binary, or text with control characters)\n%s\n", len(p), base64.StdEncoding.EncodeToString(p))
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("dead show of payload %q: want %q in:\n%s", p, want, out)
		}
		clean("dead show", out)
	}
	for _, args := range [][]string{{"dead", "list"}, {"prepared", "list"}, {"scheduled", "list"}} {
		code, out, errOut := cliEnv(t, vars, args...)
		if code != 0 {
			t.Fatalf("%s: exit %d: %s", strings.Join(args, " "), code, errOut)
		}
		clean(strings.Join(args, " "), out)
		if !strings.Contains(out, `\x1b[2J\x1b[H\nFORGED`) {
			t.Errorf("%s lacks the escaped text:\n%s", strings.Join(args, " "), out)
		}
	}
	// JSON keeps the text as it is (JSON escapes it).
	code, out, _ = cliEnv(t, vars, "dead", "show", "--json", ids[0].String())
	var m struct {
		LastError string `json:"last_error"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &m) != nil || m.LastError != strings.ReplaceAll(evil, "\x00", "") {
		t.Errorf("dead show --json: last_error %q, want %q:\n%s", m.LastError, evil, out)
	}
}

// relay prepared resume, commit and rollback print with --json one JSON object of what they
// did, as relay dead requeue --json does: {"action", "message_ids", "failed"}, lists never null;
// without --json a line per message and a count, "0 resumed" when resume --all finds nothing.
func TestPreparedSettleJSON(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		Action     string      `json:"action"`
		MessageIDs []uuid.UUID `json:"message_ids"`
		Failed     []struct {
			MessageID uuid.UUID `json:"message_id"`
			Reason    string    `json:"reason"`
		} `json:"failed"`
	}
	run := func(wantCode int, args ...string) result {
		t.Helper()
		code, out, errOut := cliEnv(t, vars, args...)
		if code != wantCode {
			t.Fatalf("%s: exit %d, want %d: %s%s", strings.Join(args, " "), code, wantCode, out, errOut)
		}
		var r result
		checkJSONConvention(t, strings.Join(args, " "), out)
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatalf("%s: not one JSON object: %v\n%s", strings.Join(args, " "), err, out)
		}
		return r
	}
	// Nothing to resume: an empty list, and "0 resumed" in text.
	if r := run(0, "prepared", "resume", "--all", "--json"); r.Action != "resume" || r.MessageIDs == nil || len(r.MessageIDs) != 0 || r.Failed == nil {
		t.Errorf("prepared resume --all --json on nothing: %+v", r)
	}
	if code, out, errOut := cliEnv(t, vars, "prepared", "resume", "--all"); code != 0 || out != "0 resumed\n" {
		t.Errorf("prepared resume --all on nothing: exit %d, %q, want \"0 resumed\\n\" %s", code, out, errOut)
	}

	var halves []uuid.UUID
	for range 4 {
		h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "payments.charged", Payload: []byte("x")}, &outbox.PrepareOptions{Group: "payments"})
		if err != nil {
			t.Fatal(err)
		}
		halves = append(halves, h.ID)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'check_exhausted' WHERE message_id = ANY($1)`, halves[:2]); err != nil {
		t.Fatal(err)
	}
	unknown := uuid.New()
	if r := run(0, "prepared", "resume", "--all", "--json"); r.Action != "resume" || !sameIDs(r.MessageIDs, halves[:2]) || len(r.Failed) != 0 {
		t.Errorf("prepared resume --all --json: %+v, want %v resumed", r, halves[:2])
	}
	if r := run(1, "prepared", "resume", "--json", halves[0].String(), unknown.String()); r.Action != "resume" || len(r.MessageIDs) != 0 ||
		len(r.Failed) != 2 || r.Failed[0].MessageID != halves[0] || !strings.Contains(r.Failed[0].Reason, "not check_exhausted") {
		t.Errorf("prepared resume --json of a prepared and an unknown id: %+v", r)
	}
	if r := run(0, "prepared", "commit", "--json", halves[0].String(), halves[1].String()); r.Action != "commit" || !sameIDs(r.MessageIDs, halves[:2]) || len(r.Failed) != 0 {
		t.Errorf("prepared commit --json: %+v", r)
	}
	if r := run(1, "prepared", "commit", "--json", halves[0].String(), halves[2].String(), unknown.String()); r.Action != "commit" ||
		!sameIDs(r.MessageIDs, halves[2:3]) || len(r.Failed) != 2 || !strings.Contains(r.Failed[0].Reason, "it is ready") || !strings.HasPrefix(r.Failed[1].Reason, "no such message") {
		t.Errorf("prepared commit --json of a settled, a prepared and an unknown id: %+v", r)
	}
	// An id given twice is one change with one answer.
	if r := run(0, "prepared", "rollback", "--json", halves[3].String(), halves[3].String()); r.Action != "rollback" || !sameIDs(r.MessageIDs, halves[3:]) ||
		len(r.MessageIDs) != 1 || len(r.Failed) != 0 {
		t.Errorf("prepared rollback --json of one id given twice: %+v", r)
	}
	// --group selects with list and resume --all only, --all with resume only: where they would
	// be ignored, they are refused.
	for _, args := range [][]string{{"resume", "--group", "x", halves[0].String()}, {"commit", "--group", "x", halves[0].String()},
		{"rollback", "--group", "x", halves[0].String()}, {"show", "--group", "x", halves[0].String()}, {"commit", "--all", halves[0].String()}} {
		flag := "--group"
		if slices.Contains(args, "--all") {
			flag = "--all"
		}
		if code, _, errOut := cliEnv(t, vars, append([]string{"prepared"}, args...)...); code != 2 || !strings.Contains(errOut, flag) {
			t.Errorf("prepared %v: exit %d, %s; want 2 naming %s", args, code, errOut, flag)
		}
	}
	if code, out, _ := cliEnv(t, vars, "prepared", "rollback", halves[3].String()); code != 1 || out != "0 rolled back\n" {
		t.Errorf("prepared rollback of a rolled back message: exit %d, %q", code, out)
	}
}

func sameIDs(a, b []uuid.UUID) bool {
	return len(a) == len(b) && !slices.ContainsFunc(a, func(id uuid.UUID) bool { return !slices.Contains(b, id) })
}

// Every admin command that changes rows reports what it did in one shape: with --json
// {"action", "message_ids", "failed": [{"message_id", "reason"}]} (relay dead adds "dry_run"),
// no other key; without it a line per row changed, a count line ("N cancelled", also 0) and on
// stderr a line per id not changed with why. An id asked for by name that was not changed —
// unknown (a typo, the wrong schema), or in another state (requeued already) — is in failed
// with its reason and makes the exit status 1, for each of dead requeue|purge --id (dry run
// too), prepared resume|commit|rollback and scheduled cancel.
func TestAdminChangeConvention(t *testing.T) {
	t.Parallel()
	e := newAdminEnv(t)
	vars := map[string]string{"DATABASE_URL": e.db.DSN, "TXOUTBOX_SCHEMA": e.db.Schema}
	unknown := uuid.New()
	ready := e.ids["c1"] // a ready row: neither dead, nor half, nor scheduled
	check := func(args []string, wantCode int, wantChanged []uuid.UUID, wantFailed map[uuid.UUID]string, dryRun bool) {
		t.Helper()
		what := strings.Join(args, " ")
		code, out, errOut := cliEnv(t, vars, append(args, "--json")...)
		if code != wantCode {
			t.Errorf("%s --json: exit %d, want %d: %s%s", what, code, wantCode, out, errOut)
		}
		doc, ok := checkJSONConvention(t, what, out).(map[string]any)
		if !ok {
			t.Fatalf("%s --json is not an object:\n%s", what, out)
		}
		keys := []string{"action", "failed", "message_ids"}
		if args[0] == "dead" {
			keys = []string{"action", "dry_run", "failed", "message_ids"}
		}
		var got []string
		for k := range doc {
			got = append(got, k)
		}
		slices.Sort(got)
		if !slices.Equal(got, keys) {
			t.Errorf("%s --json has keys %v, want %v:\n%s", what, got, keys, out)
		}
		if doc["action"] != args[1] {
			t.Errorf("%s --json: action %v, want %q", what, doc["action"], args[1])
		}
		if args[0] == "dead" && doc["dry_run"] != dryRun {
			t.Errorf("%s --json: dry_run %v, want %v", what, doc["dry_run"], dryRun)
		}
		var changed []uuid.UUID
		list, _ := doc["message_ids"].([]any)
		for _, x := range list {
			id, _ := x.(string)
			changed = append(changed, uuid.MustParse(id))
		}
		if !sameIDs(changed, wantChanged) {
			t.Errorf("%s --json: message_ids %v, want %v", what, changed, wantChanged)
		}
		failed, _ := doc["failed"].([]any)
		if len(failed) != len(wantFailed) {
			t.Errorf("%s --json: failed %v, want %d entries", what, failed, len(wantFailed))
		}
		for _, f := range failed {
			m, _ := f.(map[string]any)
			var fk []string
			for k := range m {
				fk = append(fk, k)
			}
			slices.Sort(fk)
			if !slices.Equal(fk, []string{"message_id", "reason"}) {
				t.Errorf("%s --json: a failed entry has keys %v, want message_id and reason", what, fk)
			}
			sid, _ := m["message_id"].(string)
			reason, _ := m["reason"].(string)
			id, _ := uuid.Parse(sid)
			if want, ok := wantFailed[id]; !ok || !strings.HasPrefix(reason, want) {
				t.Errorf("%s --json: failed %s with %q, want %q", what, id, m["reason"], want)
			}
		}
	}
	text := func(args []string, wantCode int, wantOut string, wantFailed map[uuid.UUID]string) {
		t.Helper()
		code, out, errOut := cliEnv(t, vars, args...)
		if code != wantCode || out != wantOut {
			t.Errorf("%s: exit %d, %q; want %d, %q (%s)", strings.Join(args, " "), code, out, wantCode, wantOut, errOut)
		}
		for id, why := range wantFailed {
			if !strings.Contains(errOut, id.String()+": "+why) {
				t.Errorf("%s: stderr %q lacks %q", strings.Join(args, " "), errOut, id.String()+": "+why)
			}
		}
	}
	noSuch := "no such message"

	// relay dead: an unknown id and a ready row named with --id, beside a dead one.
	dead := e.ids["adead"]
	ids := func(xs ...uuid.UUID) string {
		var s []string
		for _, x := range xs {
			s = append(s, x.String())
		}
		return strings.Join(s, ",")
	}
	for _, action := range []string{"requeue", "purge"} {
		check([]string{"dead", action, "--dry-run", "--id", ids(dead, unknown, ready)}, 1, []uuid.UUID{dead},
			map[uuid.UUID]string{unknown: noSuch, ready: "not dead: it is ready"}, true)
		check([]string{"dead", action, "--id", ids(unknown)}, 1, nil, map[uuid.UUID]string{unknown: noSuch}, false)
		text([]string{"dead", action, "--id", ids(unknown)}, 1, "0 dead rows "+action+"d\n", map[uuid.UUID]string{unknown: noSuch})
		text([]string{"dead", action, "--dry-run", "--id", ids(ready)}, 1, "0 dead rows would be "+action+"d\n",
			map[uuid.UUID]string{ready: "not dead: it is ready"})
	}
	// A dead row left out by another filter is named too.
	check([]string{"dead", "requeue", "--dry-run", "--subject", "orders.*", "--id", ids(dead)}, 1, nil,
		map[uuid.UUID]string{dead: "left out by the other filters"}, true)
	check([]string{"dead", "requeue", "--id", ids(dead)}, 0, []uuid.UUID{dead}, nil, false)
	// Requeued already: no longer dead.
	text([]string{"dead", "requeue", "--id", ids(dead)}, 1, "0 dead rows requeued\n", map[uuid.UUID]string{dead: "not dead: it is ready"})
	text([]string{"dead", "purge", "--id", ids(e.ids["pdead-new"])}, 0, "purged "+e.ids["pdead-new"].String()+"\n1 dead row purged\n", nil)

	// relay prepared.
	c, err := outbox.NewClient(&outbox.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	h, err := c.Prepare(context.Background(), e.db.Pool, outbox.Message{Subject: "payments.charged"}, &outbox.PrepareOptions{Group: "payments"})
	if err != nil {
		t.Fatal(err)
	}
	check([]string{"prepared", "resume", h.ID.String(), unknown.String(), ready.String()}, 1, nil,
		map[uuid.UUID]string{h.ID: "not check_exhausted: it is prepared", unknown: noSuch, ready: "not check_exhausted: it is ready"}, false)
	check([]string{"prepared", "commit", unknown.String(), ready.String()}, 1, nil,
		map[uuid.UUID]string{unknown: noSuch, ready: "not prepared or check_exhausted: it is ready"}, false)
	text([]string{"prepared", "rollback", unknown.String()}, 1, "0 rolled back\n", map[uuid.UUID]string{unknown: noSuch})
	text([]string{"prepared", "commit", h.ID.String()}, 0, "committed "+h.ID.String()+"\n1 committed\n", nil)

	// relay scheduled.
	later := time.Now().Add(time.Hour)
	s, err := c.EnqueueTx(context.Background(), e.db.Pool, outbox.Message{Subject: "orders.timeout", Key: "t1", DeliverAt: later},
		outbox.Message{Subject: "orders.timeout", Key: "t2", DeliverAt: later})
	if err != nil {
		t.Fatal(err)
	}
	check([]string{"scheduled", "cancel", s[0].String(), unknown.String(), ready.String()}, 1, []uuid.UUID{s[0]},
		map[uuid.UUID]string{unknown: noSuch, ready: "not scheduled: it is ready"}, false)
	text([]string{"scheduled", "cancel", s[1].String()}, 0, "cancelled "+s[1].String()+"\n1 cancelled\n", nil)
	text([]string{"scheduled", "cancel", s[1].String()}, 1, "0 cancelled\n", map[uuid.UUID]string{s[1]: "not scheduled: it is rolled_back"})
}

// relay dead list, prepared list and scheduled list share their rows' common fields (--json:
// message_id, state, subject, key, attempts, created_at, last_error, payload_bytes, headers,
// each list's own after them) and their text column headers' style (words separated by
// spaces: MESSAGE ID, LAST ERROR). relay run --help and relay checkback --help give --nats-url
// the default each uses when it is unset.
func TestAdminListsShareRowFields(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := testsvc.NewDB(t)
	vars := map[string]string{"DATABASE_URL": db.DSN, "TXOUTBOX_SCHEMA": db.Schema}
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	headers := map[string][]string{"Content-Type": {"application/json"}}
	payload := []byte(`{"order":7}`)
	var ids []uuid.UUID
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		ids, err = c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.paid", Key: "o1", Payload: payload, Headers: headers},
			outbox.Message{Subject: "orders.timeout", Key: "o2", Payload: payload, Headers: headers, DeliverAt: time.Now().Add(time.Hour)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(ctx, `UPDATE txoutbox_messages SET state = 'dead', attempts = 3, last_error = 'x' WHERE message_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	h, err := c.Prepare(ctx, db.Pool, outbox.Message{Subject: "orders.created", Key: "o3", Payload: payload, Headers: headers},
		&outbox.PrepareOptions{Group: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	common := []string{"message_id", "state", "subject", "key", "attempts", "created_at", "last_error", "payload_bytes", "headers"}
	for _, c := range []struct {
		list  string
		id    uuid.UUID
		state string
		own   []string
	}{
		{"dead", ids[0], "dead", nil},
		{"prepared", h.ID, "prepared", []string{"group", "mode", "checks", "next_check_at"}},
		{"scheduled", ids[1], "scheduled", []string{"biz_key", "deliver_at", "due_at"}},
	} {
		code, out, errOut := cliEnv(t, vars, c.list, "list", "--json")
		if code != 0 {
			t.Fatalf("%s list --json: exit %d: %s", c.list, code, errOut)
		}
		l, ok := checkJSONConvention(t, c.list+" list --json", out).([]any)
		if !ok || len(l) != 1 {
			t.Fatalf("%s list --json is not an array of one row:\n%s", c.list, out)
		}
		row := l[0].(map[string]any)
		var keys []string
		for k := range row {
			keys = append(keys, k)
		}
		want := append(append([]string{}, common...), c.own...)
		slices.Sort(keys)
		slices.Sort(want)
		if !slices.Equal(keys, want) {
			t.Errorf("%s list --json row keys %v, want %v", c.list, keys, want)
		}
		if row["message_id"] != c.id.String() || row["state"] != c.state || row["payload_bytes"] != float64(len(payload)) ||
			fmt.Sprint(row["headers"]) != "map[Content-Type:[application/json]]" {
			t.Errorf("%s list --json row = %v", c.list, row)
		}
		code, out, errOut = cliEnv(t, vars, c.list, "list")
		head, _, _ := strings.Cut(out, "\n")
		if code != 0 || !strings.HasPrefix(head, "MESSAGE ID ") || strings.Contains(head, "_") {
			t.Errorf("%s list: exit %d, header %q; want MESSAGE ID first and words separated by spaces (%s)", c.list, code, head, errOut)
		}
	}
	for _, cmd := range []string{"run", "checkback"} {
		_, out, _ := cliEnv(t, nil, cmd, "--help")
		_, after, _ := strings.Cut(out, "--nats-url string")
		if line := strings.SplitN(after, "\n", 3); len(line) < 2 || !strings.Contains(line[1], "default "+DefaultNATSURL) {
			t.Errorf("%s --help: --nats-url's default is not %s:%s", cmd, DefaultNATSURL, after[:min(len(after), 200)])
		}
	}
}
