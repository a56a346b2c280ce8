//go:build !txoutbox_fault

package demo

import (
	"bytes"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/fault"
)

// Built without the txoutbox_fault tag, as `go build ./cmd/producer-demo` builds it, the demo
// cannot arm a fault point, as the relay cannot: its consumer role has no -fault flag and
// ignores TXOUTBOX_FAULTS (it used to read both and kill itself at the point).
func TestProductionDemoArmsNoFault(t *testing.T) {
	var out, errOut bytes.Buffer
	code := Main([]string{"-role", "consumer", "-fault", fault.ConsumerAfterCommit + "=1"}, &out, &errOut)
	if code != 2 || !strings.Contains(errOut.String(), "flag provided but not defined: -fault") {
		t.Fatalf("-fault in a production build: exit %d, %s; want 2, the flag unknown", code, errOut.String())
	}
	// An invalid specification in the environment is not even read: the role goes on to its
	// database URL (and stops there: it does not parse), never to a fault error.
	t.Setenv(fault.EnvVar, fault.ConsumerAfterCommit+"=x")
	out.Reset()
	errOut.Reset()
	code = Main([]string{"-role", "consumer", "-database-url", "postgres://127.0.0.1:notaport/none",
		"-nats-url", "nats://127.0.0.1:1", "-schema", "s"}, &out, &errOut)
	if code != 1 || !strings.Contains(errOut.String(), "invalid DATABASE_URL") || strings.Contains(errOut.String(), "fault") {
		t.Fatalf("%s set in a production build: exit %d, %s; want the database URL refused, silent on faults", fault.EnvVar, code, errOut.String())
	}
}
