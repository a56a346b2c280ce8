package relaycli

import (
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// --fault (TXOUTBOX_FAULTS) is for crash tests: hidden from the help, and an invalid
// specification is a usage error that arms nothing. (That an armed relay dies at its point is
// tested against the built binary in internal/demo.)
func TestFaultSettingIsHiddenAndValidated(t *testing.T) {
	t.Parallel()
	code, out, _ := cliEnv(t, nil, "run", "--help")
	if code != 0 || strings.Contains(out, "--fault") || strings.Contains(out, fault.EnvVar) {
		t.Fatalf("run --help (exit %d) mentions the fault setting:\n%s", code, out)
	}
	for _, c := range []struct {
		vars map[string]string
		args []string
	}{
		{nil, []string{"run", "--fault", "relay.nowhere=1"}},
		{nil, []string{"run", "--fault", fault.RelayBeforeSettle + "=2"}},
		{map[string]string{fault.EnvVar: fault.RelayBeforeSettle + "=x"}, []string{"run"}},
	} {
		code, _, errOut := cliEnv(t, c.vars, c.args...)
		if code != 2 || !strings.Contains(errOut, "--fault") {
			t.Errorf("%v %q: exit %d, %s; want 2 naming --fault", c.vars, c.args, code, errOut)
		}
	}
}

// A NATS URL that does not parse is a usage error, reported without its password.
func TestBadNATSURLErrorHidesThePassword(t *testing.T) {
	t.Parallel()
	vars := map[string]string{"DATABASE_URL": testsvc.PostgresDSN(t), "NATS_URL": "nats://user:NatsPw1@127.0.0.1:4x22"}
	for _, cmd := range []string{"run", "checkback"} {
		code, _, errOut := cliEnv(t, vars, cmd)
		if code != 2 || !strings.Contains(errOut, "invalid --nats-url") || strings.Contains(errOut, "NatsPw1") {
			t.Errorf("%s with a bad NATS URL: exit %d, %s; want exit 2 naming --nats-url, without the password", cmd, code, errOut)
		}
	}
}
