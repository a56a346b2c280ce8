package relaycli

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/safetext"
	"github.com/txoutbox/txoutbox/internal/store"
)

// messageJSON is the JSON object of relay dead show and relay prepared show.
type messageJSON struct {
	MessageID uuid.UUID           `json:"message_id"`
	State     string              `json:"state"`
	Subject   string              `json:"subject"`
	Key       string              `json:"key"`
	Headers   map[string][]string `json:"headers"`
	// Payload is the payload as text when PayloadEncoding is "text", else its base64.
	Payload         string     `json:"payload"`
	PayloadEncoding string     `json:"payload_encoding"`
	PayloadBytes    int        `json:"payload_bytes"`
	Attempts        int32      `json:"attempts"`
	LastError       string     `json:"last_error"`
	CreatedAt       time.Time  `json:"created_at"`
	Group           string     `json:"group"`
	Mode            string     `json:"mode"`
	Checks          int32      `json:"checks"`
	NextCheckAt     *time.Time `json:"next_check_at"`
}

// payloadText reports whether a payload is shown as text: valid UTF-8 without control
// characters (safetext.ControlRune: which a terminal would act on) other than tab and newline. A
// carriage return is one: it moves the cursor back over what the line showed.
func payloadText(p []byte) bool {
	if !utf8.Valid(p) {
		return false
	}
	for _, r := range string(p) {
		if safetext.ControlRune(r) && r != '\t' && r != '\n' {
			return false
		}
	}
	return true
}

func newMessageJSON(d *store.MessageDetail) messageJSON {
	m := messageJSON{MessageID: d.MessageID, State: d.State, Subject: d.Subject, Key: d.Key, Headers: d.Headers,
		PayloadBytes: len(d.Payload), Attempts: d.Attempts, LastError: d.LastError, CreatedAt: d.CreatedAt,
		Group: d.Group, Mode: d.Mode, Checks: d.CheckCount, NextCheckAt: d.NextCheckAt}
	if m.Headers == nil {
		m.Headers = map[string][]string{}
	}
	if payloadText(d.Payload) {
		m.Payload, m.PayloadEncoding = string(d.Payload), "text"
	} else {
		m.Payload, m.PayloadEncoding = base64.StdEncoding.EncodeToString(d.Payload), "base64"
	}
	return m
}

// errWrongState: the row exists but is not of the kind the command shows.
var errWrongState = errors.New("not in a state this command shows")

// showMessage prints the row of id, which must be in one of states (what) — its headers,
// payload and last error — as text or as one JSON object.
func showMessage(ctx context.Context, env *Env, db store.DBTX, q *store.Queries, id uuid.UUID, states []string, what string, asJSON bool) error {
	d, err := q.Message(ctx, db, id)
	if errors.Is(err, store.ErrNoRow) {
		return fmt.Errorf("%s: no such message", id)
	}
	if err != nil {
		return err
	}
	if !slices.Contains(states, d.State) {
		return fmt.Errorf("%s is %s, not %s: %w", id, d.State, what, errWrongState)
	}
	m := newMessageJSON(d)
	if asJSON {
		return writeJSON(env, m)
	}
	writeMessage(env.Stdout, m)
	return nil
}

// writeMessage prints m as text; every field that comes from outside goes through printable.
func writeMessage(w io.Writer, m messageJSON) {
	line := func(k, v string) { fmt.Fprintf(w, "%-13s %s\n", k+":", v) }
	line("message_id", m.MessageID.String())
	line("state", m.State)
	line("subject", printable(m.Subject, false))
	line("key", dash(printable(m.Key, false)))
	line("created_at", m.CreatedAt.Local().Format(time.RFC3339))
	line("attempts", fmt.Sprint(m.Attempts))
	if m.Group != "" || m.Mode != "" {
		line("group", dash(printable(m.Group, false)))
		line("mode", dash(printable(m.Mode, false)))
		line("checks", fmt.Sprint(m.Checks))
		next := "-"
		if m.NextCheckAt != nil {
			next = m.NextCheckAt.Local().Format(time.RFC3339)
		}
		line("next_check_at", next)
	}
	line("last_error", dash(printable(m.LastError, false)))
	if len(m.Headers) == 0 {
		line("headers", "(none)")
	} else {
		fmt.Fprintln(w, "headers:")
		names := make([]string, 0, len(m.Headers))
		for k := range m.Headers {
			names = append(names, k)
		}
		sort.Strings(names)
		for _, k := range names {
			for _, v := range m.Headers[k] {
				fmt.Fprintf(w, "  %s: %s\n", printable(k, false), printable(v, false))
			}
		}
	}
	if m.PayloadEncoding == "text" {
		fmt.Fprintf(w, "payload:      %d bytes, text\n", m.PayloadBytes)
		fmt.Fprint(w, m.Payload)
		if m.Payload != "" && !strings.HasSuffix(m.Payload, "\n") {
			fmt.Fprintln(w)
		}
		return
	}
	fmt.Fprintf(w, "payload:      %d bytes, base64 (binary, or text with control characters)\n", m.PayloadBytes)
	for p := m.Payload; p != ""; {
		n := min(len(p), 76)
		fmt.Fprintln(w, p[:n])
		p = p[n:]
	}
}
