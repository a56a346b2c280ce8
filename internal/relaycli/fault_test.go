package relaycli

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/txoutbox/txoutbox/internal/fault"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// --fault (TXOUTBOX_FAULTS) exists only in relays built with -tags txoutbox_fault, for the
// crash tests: a production build refuses the flag and ignores the variable, so nothing can
// arm a fault point there. A test build hides it from the help and refuses an invalid
// specification. (That an armed relay dies at its point is tested in internal/demo.)
func TestFaultSettingExistsOnlyInTestBuilds(t *testing.T) {
	t.Parallel()
	if fault.Enabled {
		t.Fatal("the test binary is built with txoutbox_fault; these tests expect a production build")
	}
	code, out, _ := cliEnv(t, nil, "run", "--help")
	if code != 0 || strings.Contains(out, "--fault") || strings.Contains(out, fault.EnvVar) {
		t.Fatalf("run --help (exit %d) mentions the fault setting:\n%s", code, out)
	}
	code, _, errOut := cliEnv(t, nil, "run", "--fault", fault.RelayBeforeSettle+"=1")
	if code != 2 || !strings.Contains(errOut, "-fault") {
		t.Fatalf("a production build with --fault: exit %d, %s; want 2, the flag unknown", code, errOut)
	}
	// The variable is not read: the run fails on what is really missing, not on the fault.
	code, _, errOut = cliEnv(t, map[string]string{fault.EnvVar: fault.RelayBeforeSettle + "=x"}, "run")
	if code != 2 || strings.Contains(errOut, "--fault") || strings.Contains(errOut, fault.EnvVar) {
		t.Fatalf("a production build with %s set: exit %d, %s; want the usual usage error, silent on faults", fault.EnvVar, code, errOut)
	}

	bin := relayBinary(t) // built with txoutbox_fault
	for _, c := range []struct {
		env  []string
		args []string
	}{
		{nil, []string{"run", "--fault", "relay.nowhere=1"}},
		{nil, []string{"run", "--fault", fault.RelayBeforeSettle + "=2"}},
		{[]string{fault.EnvVar + "=" + fault.RelayBeforeSettle + "=x"}, []string{"run"}},
	} {
		cmd := exec.Command(bin, c.args...)
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, c.env...)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "--fault") {
			t.Errorf("test build %v %q: %v, %s; want exit 2 naming --fault", c.env, c.args, err, out)
		}
	}
	cmd := exec.Command(bin, "run", "--help")
	help, _ := cmd.CombinedOutput()
	if strings.Contains(string(help), "--fault") {
		t.Errorf("a test build's help shows --fault:\n%s", help)
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

// A production relay binary (built without txoutbox_fault) holds none of the fault machinery:
// no symbol of package fault (its specification parser, its point table) and no point name,
// so nothing in it can arm a point, not even by a path the flag parser does not guard.
func TestProductionBinaryHasNoFaultCode(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("builds the relay")
	}
	bin := filepath.Join(t.TempDir(), "relay")
	build := exec.Command(testsvc.GoTool(), "build", "-o", bin, "github.com/txoutbox/txoutbox/cmd/relay")
	build.Env = append(os.Environ(), "CGO_ENABLED=0") // as testsvc.RelayBinary: the build cache is shared
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/relay: %v\n%s", err, out)
	}
	syms, err := exec.Command(testsvc.GoTool(), "tool", "nm", bin).Output()
	if err != nil {
		t.Fatalf("go tool nm: %v", err)
	}
	const pkg = "github.com/txoutbox/txoutbox/internal/fault."
	for _, line := range strings.Split(string(syms), "\n") {
		if strings.Contains(line, pkg) {
			t.Errorf("the production relay binary has the fault symbol %s", strings.TrimSpace(line))
		}
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range append(fault.Points(), fault.EnvVar) {
		if bytes.Contains(data, []byte(s)) {
			t.Errorf("the production relay binary contains %q", s)
		}
	}
}
