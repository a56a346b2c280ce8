// Package natsname holds the NATS naming rules the relay and the consumer share: which
// subjects a subject filter covers, and which stream and consumer names JetStream accepts.
package natsname

import (
	"errors"
	"fmt"
	"strings"
)

// Covers reports whether every subject that subj matches is also matched by filter. Both may
// hold wildcards ('*' for one token, '>' for one or more at the end); for a subj without
// wildcards it is NATS's subject match.
func Covers(filter, subj string) bool {
	f, s := strings.Split(filter, "."), strings.Split(subj, ".")
	for i, ft := range f {
		if ft == ">" {
			return i < len(s)
		}
		if i >= len(s) {
			return false
		}
		switch st := s[i]; {
		case st == ">":
			return false
		case ft == "*":
		case ft != st:
			return false
		}
	}
	return len(f) == len(s)
}

// MaxNameLength is the longest stream or consumer name JetStream accepts, in bytes
// (nats-server's JSMaxNameLen).
const MaxNameLength = 255

// nameForbidden are the characters JetStream refuses in a stream or consumer name: subject
// separators and wildcards, white space, and path separators (names become file names).
const nameForbidden = ".*> \t\r\n/\\"

// ValidateName reports whether name is a stream or consumer name JetStream accepts: not
// empty, at most MaxNameLength bytes, and none of '.', '*', '>', white space, '/' or '\'.
// Its errors read after the field's name ("Config.Stream is required").
func ValidateName(name string) error {
	switch {
	case name == "":
		return errors.New("is required")
	case len(name) > MaxNameLength:
		return fmt.Errorf("is %d bytes long, more than JetStream's %d", len(name), MaxNameLength)
	case strings.ContainsAny(name, nameForbidden):
		return fmt.Errorf("%q must not contain '.', '*', '>', white space, '/' or '\\'", name)
	}
	return nil
}
