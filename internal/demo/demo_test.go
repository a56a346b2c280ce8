package demo

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/internal/testsvc"
)

func TestMain(m *testing.M) {
	code := testsvc.Main(m)
	if demoDir != "" {
		_ = os.RemoveAll(demoDir)
	}
	os.Exit(code)
}

// relayBinary is the real relay command, built once per test binary.
func relayBinary(t *testing.T) string { return testsvc.RelayBinary(t) }

var (
	demoOnce sync.Once
	demoDir  string
	demoPath string
	demoErr  error
)

// demoBinary builds ./cmd/producer-demo with the txoutbox_fault tag once per test binary and
// returns its path: the consumer process of the chaos run and the fault tests, whose fault
// point only such a build can arm (a production build has no -fault and ignores
// TXOUTBOX_FAULTS, as the relay).
func demoBinary(t *testing.T) string {
	t.Helper()
	demoOnce.Do(func() {
		if demoDir, demoErr = os.MkdirTemp("", "txoutbox-demo-bin-"); demoErr != nil {
			return
		}
		demoPath = filepath.Join(demoDir, "producer-demo")
		cmd := exec.Command(testsvc.GoTool(), "build", "-tags", "txoutbox_fault", "-o", demoPath, "github.com/txoutbox/txoutbox/cmd/producer-demo")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0") // as testsvc.RelayBinary: the build cache is shared
		if out, err := cmd.CombinedOutput(); err != nil {
			demoErr = fmt.Errorf("%w\n%s", err, out)
		}
	})
	if demoErr != nil {
		t.Fatalf("go build -tags txoutbox_fault ./cmd/producer-demo: %v", demoErr)
	}
	return demoPath
}

// consumerChild returns a command that runs the consumer role in a child process.
func consumerChild(ctx context.Context, t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.CommandContext(ctx, demoBinary(t), append([]string{"-role", "consumer"}, args...)...)
	cmd.Env = childEnv()
	return cmd
}

// The demo, as `go run ./cmd/producer-demo` runs it but smaller and with faults frequent
// enough to happen in every run: every invariant holds, and each fault left its trace.
func TestDemo(t *testing.T) {
	t.Parallel()
	cfg := DefaultConfig()
	cfg.DSN = testsvc.PostgresDSN(t)
	cfg.Orders, cfg.Payments, cfg.Rate = 150, 30, 150
	cfg.LoseAcks, cfg.ConsumerCrash, cfg.Duplicates = 0.05, 0.05, 0.1
	cfg.Timeout = 3 * time.Minute
	var out bytes.Buffer
	res, err := Run(context.Background(), cfg, &out)
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	if !res.OK() {
		t.Fatalf("an invariant did not hold:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "All invariants held.") || !strings.Contains(out.String(), "Summary (") {
		t.Errorf("the output lacks its summary:\n%s", out.String())
	}
	committed := res.Orders + res.Poisoned + res.RolledBackOrders
	switch {
	case committed != int64(cfg.Orders):
		t.Errorf("orders: %d committed + %d poisoned + %d rolled back, want %d in all", res.Orders, res.Poisoned, res.RolledBackOrders, cfg.Orders)
	case res.Payments != int64(cfg.Payments):
		t.Errorf("payments: %d prepared, want %d", res.Payments, cfg.Payments)
	case res.Poisoned != int64(cfg.Poison) || res.DeadDistinct != int64(cfg.Poison):
		t.Errorf("poisoned %d, dead letters %d, want %d", res.Poisoned, res.DeadDistinct, cfg.Poison)
	case res.LostAcks == 0 || res.RelayDuplicates == 0:
		t.Errorf("lost PubAcks %d, JetStream duplicates %d: the lost acks should have made the relay republish", res.LostAcks, res.RelayDuplicates)
	case res.ConsumerCrashes == 0:
		t.Errorf("no consumer crash at a 5%% rate")
	case res.ConsumerDuplicates < res.OrderCopies+res.ConsumerCrashes:
		// Every copy is a duplicate, and so is the redelivery of the message each crash left unacked.
		t.Errorf("duplicates caught %d < copies %d + crashes %d", res.ConsumerDuplicates, res.OrderCopies, res.ConsumerCrashes)
	case res.ConsumerRetries < int64(cfg.Poison):
		t.Errorf("retries %d: each poisoned order should have been retried", res.ConsumerRetries)
	case res.HalfCommittedByCheckback < res.PaymentsByFate[fateDieAfterCharge] || res.HalfRolledBackByCheckback < res.PaymentsByFate[fateDieBeforeCharge]:
		t.Errorf("check-back settled %d/%d (commit/rollback), producers that died: %d after and %d before charging",
			res.HalfCommittedByCheckback, res.HalfRolledBackByCheckback, res.PaymentsByFate[fateDieAfterCharge], res.PaymentsByFate[fateDieBeforeCharge])
	case res.Effects != res.Orders+res.Charged:
		t.Errorf("effects %d, want %d orders + %d charged payments", res.Effects, res.Orders, res.Charged)
	}
	t.Logf("demo took %s; %d lost acks, %d consumer crashes, %d duplicates caught", res.Elapsed, res.LostAcks, res.ConsumerCrashes, res.ConsumerDuplicates)

	// After it, not beside it: the consumer's crash point is process-wide, and two demos
	// running at once in one process would crash each other's consumers.
	demoOnExternalNATS(t)
}

func TestMainUsage(t *testing.T) {
	t.Parallel()
	var out, errOut bytes.Buffer
	if code := Main([]string{"-help"}, &out, &errOut); code != 0 {
		t.Fatalf("-help: exit %d, %s", code, errOut.String())
	}
	help := out.String()
	for _, want := range []string{"-lose-acks", "-consumer-crash", "-duplicates", "-poison", "-chaos", "-messages", "-cluster", "-relays"} {
		if !strings.Contains(help, want) {
			t.Errorf("help lacks %s:\n%s", want, help)
		}
	}
	for name := range hidden {
		if strings.Contains(help, "-"+name+" ") {
			t.Errorf("help shows the hidden flag -%s", name)
		}
	}
	for _, args := range [][]string{{"-nope"}, {"-rollback", "0.9"}, {"-orders", "0"}, {"-role", "nope"}, {"extra"}, {"-cluster"}, {"-chaos", "-relays", "1"}} {
		errOut.Reset()
		if code := Main(args, &out, &errOut); code != 2 {
			t.Errorf("%q: exit %d, want 2 (%s)", args, code, errOut.String())
		}
	}
}

// demoOnExternalNATS: with NATS_URL (someone else's server) the demo creates its streams,
// removes them at exit, and refuses to run over a stream of the same name.
func demoOnExternalNATS(t *testing.T) {
	n := testsvc.NewNATS(t)
	cfg := DefaultConfig()
	cfg.DSN, cfg.NATSURL = testsvc.PostgresDSN(t), n.URL()
	cfg.Orders, cfg.Payments, cfg.Rate, cfg.Poison = 40, 8, 200, 1
	cfg.Timeout = 2 * time.Minute
	var out bytes.Buffer
	res, err := Run(context.Background(), cfg, &out)
	if err != nil || !res.OK() {
		t.Fatalf("demo: %v\n%s", err, out.String())
	}
	ctx := context.Background()
	for _, name := range []string{streamName, deadStreamName} {
		if _, err := n.JS.Stream(ctx, name); err == nil {
			t.Errorf("stream %s is still there after the demo", name)
		}
	}
	n.Stream(t, streamName, "elsewhere.>")
	out.Reset()
	if _, err := Run(ctx, cfg, &out); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("over an existing stream: %v", err)
	}
	if _, err := n.JS.Stream(ctx, streamName); err != nil {
		t.Fatalf("the demo removed a stream it did not create: %v", err)
	}
}
