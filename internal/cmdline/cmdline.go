// Package cmdline builds the admin command lines txoutbox suggests to an operator, in logs,
// errors, the status page and /status.json.
package cmdline

import (
	"regexp"
	"strings"

	"github.com/txoutbox/txoutbox"
)

// Command is an admin command line to suggest to an operator for the outbox in schema: words
// (the command and its arguments, joined by spaces), then --schema and the schema, quoted for
// a POSIX shell when it needs to be, unless schema is the default (txoutbox.DefaultSchema,
// which every command uses without --schema). Every command text the status page,
// /status.json, relay status and the commands' own hints print is built with it: one without
// --schema would act on the default schema's outbox (or, after `relay migrate up`, a new empty
// one) instead of this one.
func Command(schema string, words ...string) string {
	cmd := strings.Join(words, " ")
	if schema == "" || schema == txoutbox.DefaultSchema {
		return cmd
	}
	return cmd + " --schema " + ShellQuote(schema)
}

var shellSafe = regexp.MustCompile(`^[A-Za-z0-9_./:@%+=,-]+$`)

// ShellQuote returns s as one word for a POSIX shell: as it is when it has only characters
// no shell treats specially, else in single quotes (a single quote in s closes them, is
// escaped with a backslash and reopens them).
func ShellQuote(s string) string {
	if shellSafe.MatchString(s) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
