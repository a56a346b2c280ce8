package relaycli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/testsvc"
	"github.com/txoutbox/txoutbox/outbox"
)

// podmanFlags are podman's global flags for the test: TXOUTBOX_PODMAN_FLAGS when set, else
// what works on machines where podman runs as root without systemd or cgroup v2 (a VM or a
// container): the vfs storage driver (no overlay mounts), cgroupfs, and runc when installed
// (crun refuses hybrid cgroup hierarchies).
func podmanFlags() []string {
	if f, ok := os.LookupEnv("TXOUTBOX_PODMAN_FLAGS"); ok {
		return strings.Fields(f)
	}
	flags := []string{"--storage-driver=vfs", "--cgroup-manager=cgroupfs"}
	if _, err := exec.LookPath("runc"); err == nil {
		flags = append(flags, "--runtime=runc")
	}
	return flags
}

// containerRunFlags: the host's network (the test's PostgreSQL and NATS listen on
// 127.0.0.1), and explicit resource limits no higher than the defaults of most hosts (podman's
// own defaults raise them, which a sandbox without CAP_SYS_RESOURCE refuses).
var containerRunFlags = []string{"--network=host", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"}

// cannotRun tells podman output that says containers cannot run on this machine (as opposed
// to a broken image).
func cannotRun(out string) bool {
	for _, s := range []string{"OCI runtime", "OCI permission", "cgroup", "runc create failed", "crun:", "setrlimit", "newuidmap", "user namespace"} {
		if strings.Contains(out, s) {
			return true
		}
	}
	return false
}

// The container image of deploy/container/Containerfile, built with podman from the static
// relay binary (FROM scratch: no registry needed): its user is 65532, its entrypoint relay,
// it has no shell; relay version runs in it and says what the binary says outside; and the
// container's relay, on the host network, publishes a row of the test's PostgreSQL to the
// test's NATS, answers /readyz, and stops on SIGTERM with exit status 0. Skips, saying why,
// where podman is missing or cannot run containers.
func TestContainerImage(t *testing.T) {
	t.Parallel()
	podman, err := exec.LookPath("podman")
	if err != nil {
		t.Skip("podman is not installed (.ci/run installs it when run as root)")
	}
	const certs = "/etc/ssl/certs/ca-certificates.crt"
	if _, err := os.Stat(certs); err != nil {
		t.Skipf("no CA bundle to put in the image: %v", err)
	}
	global := podmanFlags()
	pm := func(timeout time.Duration, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		out, err := exec.CommandContext(ctx, podman, append(append([]string(nil), global...), args...)...).CombinedOutput()
		return string(out), err
	}

	// The build context: the binary and the CA bundle, nothing else. The binary is built as
	// the Containerfile's build stage builds it (no fault points), not the test suite's relay
	// (which has the fault points compiled in); without -trimpath, which changes only the file
	// paths the binary holds and would compile every dependency again instead of using the
	// build cache.
	bin := filepath.Join(t.TempDir(), "relay")
	build := exec.Command(testsvc.GoTool(), "build", "-buildvcs=auto", "-o", bin, "./cmd/relay")
	build.Dir = filepath.Join("..", "..")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/relay as the Containerfile does: %v\n%s", err, out)
	}
	dir := t.TempDir()
	for src, dst := range map[string]string{bin: "relay", certs: "ca-certificates.crt"} {
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, dst), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	containerfile, err := filepath.Abs(filepath.Join(deployDir, "container", "Containerfile"))
	if err != nil {
		t.Fatal(err)
	}
	tag := "localhost/txoutbox-relay-test:" + randomSuffix()
	// The images the build makes (the tagged one and its stages' intermediate images) are
	// removed at the end: those that were not there before it.
	images := func() map[string]bool {
		out, _ := pm(time.Minute, "images", "-a", "-q", "--no-trunc")
		ids := map[string]bool{}
		for _, id := range strings.Fields(out) {
			ids[id] = true
		}
		return ids
	}
	before := images()
	start := time.Now()
	if out, err := pm(3*time.Minute, "build", "--build-arg", "SOURCE=prebuilt", "-f", containerfile, "-t", tag, dir); err != nil {
		if cannotRun(out) {
			t.Skipf("podman cannot build images here: %s", firstLine([]byte(out)))
		}
		t.Fatalf("podman build: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		_, _ = pm(time.Minute, "rmi", "-f", tag)
		for id := range images() {
			if !before[id] {
				_, _ = pm(time.Minute, "rmi", "-f", id)
			}
		}
	})
	t.Logf("image built in %s", time.Since(start).Round(time.Millisecond))

	out, err := pm(time.Minute, "image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}}", tag)
	if err != nil || strings.TrimSpace(out) != `65532:65532 ["relay"]` {
		t.Fatalf("image user and entrypoint: %q (%v), want 65532:65532 [\"relay\"]", out, err)
	}

	// relay version in the container is the binary's.
	out, err = pm(time.Minute, append(append([]string{"run", "--rm"}, containerRunFlags...), tag, "version", "--json")...)
	if err != nil {
		if cannotRun(out) {
			t.Skipf("podman cannot run containers here: %s", firstLine([]byte(out)))
		}
		t.Fatalf("relay version in the container: %v\n%s", err, out)
	}
	host, err := exec.Command(bin, "version", "--json").Output()
	if err != nil {
		t.Fatal(err)
	}
	var in, outside BuildInfo
	if json.Unmarshal([]byte(out), &in) != nil || json.Unmarshal(host, &outside) != nil || !reflect.DeepEqual(in, outside) {
		t.Fatalf("relay version in the container:\n%s\noutside:\n%s", out, host)
	}
	// No shell in the image.
	if out, err := pm(time.Minute, append(append([]string{"run", "--rm", "--entrypoint", "/bin/sh"}, containerRunFlags...), tag, "-c", "true")...); err == nil {
		t.Errorf("the image has a shell:\n%s", out)
	}

	// The container's relay publishes a row of the test's outbox.
	db := testsvc.NewDB(t)
	n := testsvc.NewNATS(t)
	n.Stream(t, "ORDERS", "orders.>")
	c, err := outbox.NewClient(&outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var ids []string
	err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		got, err := c.EnqueueTx(ctx, tx, outbox.Message{Subject: "orders.created", Key: "order-1", Payload: []byte(`{"id":1}`)})
		for _, id := range got {
			ids = append(ids, id.String())
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	port, err := embedded.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	name := "txoutbox-relay-test-" + randomSuffix()
	args := append(append([]string{"run", "-d", "--name", name}, containerRunFlags...),
		"-e", "DATABASE_URL="+db.DSN, "-e", "NATS_URL="+n.URL(), "-e", "TXOUTBOX_SCHEMA="+db.Schema,
		tag, "run", "--no-checkback", "--log-format", "json", "--poll-max", "100ms",
		"--metrics-addr", fmt.Sprintf("127.0.0.1:%d", port))
	if out, err := pm(time.Minute, args...); err != nil {
		t.Fatalf("podman run -d: %v\n%s", err, out)
	}
	t.Cleanup(func() { _, _ = pm(time.Minute, "rm", "-f", "-t", "0", name) })
	logs := func() string { out, _ := pm(time.Minute, "logs", name); return out }

	testsvc.Eventually(t, 30*time.Second, "the container's relay publishes the row", func() bool {
		return len(testsvc.StreamMsgs(t, n.JS, "ORDERS")) > 0
	})
	msgs := testsvc.StreamMsgs(t, n.JS, "ORDERS")
	if len(msgs) != 1 || msgs[0].Header.Get("Nats-Msg-Id") != ids[0] || string(msgs[0].Data) != `{"id":1}` {
		t.Fatalf("stream holds %d messages (first: %+v), want the row %s\n%s", len(msgs), msgs, ids[0], logs())
	}
	readyz := fmt.Sprintf("http://127.0.0.1:%d/readyz", port)
	testsvc.Eventually(t, 10*time.Second, "/readyz answers 200", func() bool {
		resp, err := http.Get(readyz)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	// podman stop sends SIGTERM (the image's default stop signal): a clean drain, exit 0.
	start = time.Now()
	if out, err := pm(time.Minute, "stop", "-t", "30", name); err != nil {
		t.Fatalf("podman stop: %v\n%s", err, out)
	}
	stopped := time.Since(start)
	out, err = pm(time.Minute, "inspect", "--format", "{{.State.ExitCode}}", name)
	if err != nil || strings.TrimSpace(out) != "0" {
		t.Fatalf("the container's relay exited with %q (%v) after SIGTERM, want 0\n%s", out, err, logs())
	}
	if l := logs(); !bytes.Contains([]byte(l), []byte(`"relay stopped"`)) {
		t.Errorf("the relay did not log its stop:\n%s", l)
	}
	t.Logf("SIGTERM to exit (podman stop): %s", stopped.Round(time.Millisecond))
}
