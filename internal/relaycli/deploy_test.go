package relaycli

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/relay"
	"go.yaml.in/yaml/v3"
)

const deployDir = "../../deploy"

// drainBound is the longest a relay takes to stop after SIGTERM with default settings, the
// bound the code keeps (runStopBound, TestRelayStopsInTimeWhenPostgresFreezes): the PubAcks
// of the batch in flight (at most --publish-timeout) and its settle (relay.DrainSettleTimeout),
// the release of the partitions (relay.ReleaseTimeout), the close of the pool, and with
// tracing on the flush of the last spans. Grace periods and stop timeouts must be longer.
var drainBound = runStopBound(&relay.Config{}, true)

// envNames returns the environment variables `relay <cmd> --help` lists.
func envNames(t *testing.T, cmd ...string) map[string]bool {
	t.Helper()
	code, out, _ := cliEnv(t, nil, append(cmd, "--help")...)
	if code != 0 {
		t.Fatalf("relay %v --help: exit %d", cmd, code)
	}
	names := map[string]bool{}
	for _, l := range strings.Split(out, "\n") {
		f := strings.Fields(l)
		if len(f) >= 2 && f[0] == "env" {
			names[strings.TrimSuffix(f[1], ",")] = true
		}
	}
	if len(names) < 2 {
		t.Fatalf("relay %v --help lists no environment variables:\n%s", cmd, out)
	}
	return names
}

// k8s types: only the fields the test looks at.
type (
	k8sObject struct {
		APIVersion string            `yaml:"apiVersion"`
		Kind       string            `yaml:"kind"`
		Metadata   k8sMeta           `yaml:"metadata"`
		StringData map[string]string `yaml:"stringData"`
		Spec       struct {
			Replicas *int `yaml:"replicas"`
			Selector struct {
				MatchLabels map[string]string `yaml:"matchLabels"`
			} `yaml:"selector"`
			Template struct {
				Metadata k8sMeta `yaml:"metadata"`
				Spec     k8sPod  `yaml:"spec"`
			} `yaml:"template"`
		} `yaml:"spec"`
		Resources []string `yaml:"resources"` // a Kustomization
	}
	k8sMeta struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	}
	k8sPod struct {
		TerminationGracePeriodSeconds *int `yaml:"terminationGracePeriodSeconds"`
		SecurityContext               struct {
			RunAsNonRoot *bool `yaml:"runAsNonRoot"`
			RunAsUser    *int  `yaml:"runAsUser"`
			FSGroup      *int  `yaml:"fsGroup"`
		} `yaml:"securityContext"`
		Containers []k8sContainer `yaml:"containers"`
		Volumes    []struct {
			Name   string `yaml:"name"`
			Secret *struct {
				SecretName  string `yaml:"secretName"`
				DefaultMode *int   `yaml:"defaultMode"`
			} `yaml:"secret"`
		} `yaml:"volumes"`
	}
	k8sContainer struct {
		Name  string   `yaml:"name"`
		Image string   `yaml:"image"`
		Args  []string `yaml:"args"`
		Env   []struct {
			Name      string `yaml:"name"`
			Value     string `yaml:"value"`
			ValueFrom *struct {
				SecretKeyRef *struct {
					Name string `yaml:"name"`
					Key  string `yaml:"key"`
				} `yaml:"secretKeyRef"`
				FieldRef *struct {
					FieldPath string `yaml:"fieldPath"`
				} `yaml:"fieldRef"`
			} `yaml:"valueFrom"`
		} `yaml:"env"`
		Ports []struct {
			Name          string `yaml:"name"`
			ContainerPort int    `yaml:"containerPort"`
		} `yaml:"ports"`
		VolumeMounts []struct {
			Name      string `yaml:"name"`
			MountPath string `yaml:"mountPath"`
			ReadOnly  bool   `yaml:"readOnly"`
		} `yaml:"volumeMounts"`
		LivenessProbe  *k8sProbe `yaml:"livenessProbe"`
		ReadinessProbe *k8sProbe `yaml:"readinessProbe"`
		Resources      struct {
			Requests map[string]string `yaml:"requests"`
			Limits   map[string]string `yaml:"limits"`
		} `yaml:"resources"`
		SecurityContext struct {
			AllowPrivilegeEscalation *bool `yaml:"allowPrivilegeEscalation"`
			ReadOnlyRootFilesystem   *bool `yaml:"readOnlyRootFilesystem"`
			Capabilities             struct {
				Drop []string `yaml:"drop"`
			} `yaml:"capabilities"`
		} `yaml:"securityContext"`
	}
	k8sProbe struct {
		HTTPGet struct {
			Path string    `yaml:"path"`
			Port yaml.Node `yaml:"port"`
		} `yaml:"httpGet"`
	}
)

// decodeManifests decodes every YAML document of every file in dir.
func decodeManifests(t *testing.T, dir string) (map[string][]k8sObject, []string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in %s: %v", dir, err)
	}
	byKind := map[string][]k8sObject{}
	var names []string
	for _, f := range files {
		names = append(names, filepath.Base(f))
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		dec := yaml.NewDecoder(bytes.NewReader(data))
		for i := 0; ; i++ {
			var o k8sObject
			err := dec.Decode(&o)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s, document %d: %v", f, i, err)
			}
			if o.Kind == "" || o.APIVersion == "" {
				t.Fatalf("%s, document %d has no kind or apiVersion", f, i)
			}
			byKind[o.Kind] = append(byKind[o.Kind], o)
		}
	}
	return byKind, names
}

// The Kubernetes manifests decode, and say what the relay needs: probes on the relay's
// /healthz and /readyz on the port its --metrics-addr listens on, a grace period longer than
// the relay's drain, resources, a non-root user (the image's), the migration Job, the URLs
// from the Secret (the relays' as the relay role, the Job's as the admin role, which
// migrates), the NATS credentials files from a Secret volume the relay's group can read, and
// only environment variables the relay reads.
func TestKubernetesManifests(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(deployDir, "kubernetes")
	objs, files := decodeManifests(t, dir)
	runEnv, migrateEnv := envNames(t, "run"), envNames(t, "migrate")

	for _, kind := range []string{"Job", "Deployment", "Kustomization"} {
		if len(objs[kind]) != 1 {
			t.Fatalf("%d %s objects, want 1", len(objs[kind]), kind)
		}
	}
	secrets := map[string]map[string]string{}
	for _, o := range objs["Secret"] {
		secrets[o.Metadata.Name] = o.StringData
	}
	secret := secrets["txoutbox-relay"]
	for _, k := range []string{"database-url", "admin-database-url", "nats-url"} {
		if secret[k] == "" {
			t.Errorf("the Secret txoutbox-relay has no %s", k)
		}
	}
	// Two logins: the relays' is not the one that migrates.
	userOf := func(key string) string {
		u, err := url.Parse(secret[key])
		if err != nil || u.User == nil {
			t.Fatalf("%s %q: no user (%v)", key, secret[key], err)
		}
		return u.User.Username()
	}
	if userOf("database-url") == userOf("admin-database-url") {
		t.Errorf("database-url and admin-database-url log in as the same role %s: the relays need the relay role, the migration the admin role", userOf("database-url"))
	}
	for _, key := range []string{"database-url", "admin-database-url"} {
		checkLoginName(t, "the Secret's "+key, userOf(key))
	}
	kust := objs["Kustomization"][0]
	for _, f := range files {
		if f != "kustomization.yaml" && !slices.Contains(kust.Resources, f) {
			t.Errorf("kustomization.yaml does not list %s", f)
		}
	}

	// checkEnv: every variable is one the command reads; secrets come from the Secret.
	checkEnv := func(what string, c k8sContainer, known map[string]bool) (map[string]string, map[string]string) {
		vals, keys := map[string]string{}, map[string]string{}
		for _, e := range c.Env {
			if !known[e.Name] {
				t.Errorf("%s sets %s, which the relay does not read", what, e.Name)
			}
			vals[e.Name] = e.Value
			if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
				ref := e.ValueFrom.SecretKeyRef
				if secrets[ref.Name][ref.Key] == "" {
					t.Errorf("%s: %s refers to secret %s key %s, which no Secret has", what, e.Name, ref.Name, ref.Key)
				}
				vals[e.Name] = "(secret)"
				keys[e.Name] = ref.Key
			}
		}
		if vals["DATABASE_URL"] != "(secret)" {
			t.Errorf("%s: DATABASE_URL does not come from the Secret", what)
		}
		return vals, keys
	}
	checkSecurity := func(what string, pod k8sPod, c k8sContainer) {
		sc := pod.SecurityContext
		if sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532 {
			t.Errorf("%s: pod securityContext %+v, want runAsNonRoot and runAsUser 65532 (the image's USER)", what, sc)
		}
		csc := c.SecurityContext
		if csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation || csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem ||
			!slices.Contains(csc.Capabilities.Drop, "ALL") {
			t.Errorf("%s: container securityContext %+v, want no privilege escalation, a read-only root and every capability dropped", what, csc)
		}
		if c.Resources.Requests["cpu"] == "" || c.Resources.Requests["memory"] == "" || c.Resources.Limits["memory"] == "" {
			t.Errorf("%s: resources %+v, want cpu and memory requests and a memory limit", what, c.Resources)
		}
	}

	job := objs["Job"][0]
	if n := len(job.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("the Job has %d containers", n)
	}
	jc := job.Spec.Template.Spec.Containers[0]
	if !slices.Equal(jc.Args, []string{"migrate", "up"}) {
		t.Errorf("the Job runs relay %v, want relay migrate up", jc.Args)
	}
	if _, keys := checkEnv("the Job", jc, migrateEnv); keys["DATABASE_URL"] != "admin-database-url" {
		t.Errorf("the Job's DATABASE_URL is the Secret's %q, want admin-database-url (relay migrate up needs the admin role)", keys["DATABASE_URL"])
	}
	checkSecurity("the Job", job.Spec.Template.Spec, jc)
	// A Job's template is immutable: an apply with a new image fails while the finished Job
	// exists (ttlSecondsAfterFinished), so its manifest says how to upgrade, by its name.
	jobText, err := os.ReadFile(filepath.Join(dir, "migrate-job.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if del := "kubectl delete job " + job.Metadata.Name + " --ignore-not-found"; job.Metadata.Name == "" || !strings.Contains(string(jobText), del) {
		t.Errorf("migrate-job.yaml does not say to run %q before applying an upgrade", del)
	}

	dep := objs["Deployment"][0]
	pod := dep.Spec.Template.Spec
	if n := len(pod.Containers); n != 1 {
		t.Fatalf("the Deployment has %d containers", n)
	}
	c := pod.Containers[0]
	if !slices.Equal(c.Args, []string{"run"}) {
		t.Errorf("the Deployment runs relay %v, want relay run", c.Args)
	}
	for k, v := range dep.Spec.Selector.MatchLabels {
		if dep.Spec.Template.Metadata.Labels[k] != v {
			t.Errorf("the selector's %s=%s is not a label of the pods", k, v)
		}
	}
	vals, keys := checkEnv("the Deployment", c, runEnv)
	if vals["NATS_URL"] != "(secret)" {
		t.Error("NATS_URL does not come from the Secret")
	}
	if keys["DATABASE_URL"] != "database-url" {
		t.Errorf("the relays' DATABASE_URL is the Secret's %q, want database-url (the relay role)", keys["DATABASE_URL"])
	}
	// NATS credentials files: every variable naming a file under a mounted volume names a key
	// of the volume's Secret; the mount is read-only and the relay's group reads the files.
	mounted := map[string]string{} // mount path -> secret name
	for _, m := range c.VolumeMounts {
		for _, v := range pod.Volumes {
			if v.Name != m.Name {
				continue
			}
			if v.Secret == nil || secrets[v.Secret.SecretName] == nil {
				t.Fatalf("volume %s is not one of the Secrets %v", v.Name, slices.Collect(maps.Keys(secrets)))
			}
			if !m.ReadOnly {
				t.Errorf("volume %s is mounted read-write", v.Name)
			}
			if fg := pod.SecurityContext.FSGroup; fg == nil || *fg != 65532 || v.Secret.DefaultMode == nil || *v.Secret.DefaultMode&0o040 == 0 || *v.Secret.DefaultMode&0o007 != 0 {
				t.Errorf("volume %s: fsGroup %s, defaultMode %v: want the relay's group (65532) to read the files, and nobody else", v.Name, fmtPtr(fg), v.Secret.DefaultMode)
			}
			mounted[strings.TrimSuffix(m.MountPath, "/")+"/"] = v.Secret.SecretName
		}
	}
	fromVolumes := 0
	for name, val := range vals {
		for dir, sec := range mounted {
			if key, ok := strings.CutPrefix(val, dir); ok {
				fromVolumes++
				if secrets[sec][key] == "" {
					t.Errorf("%s=%s: the Secret %s mounted at %s has no key %s", name, val, sec, dir, key)
				}
			}
		}
	}
	if !strings.HasPrefix(vals["TXOUTBOX_NATS_CREDS"], "/") || fromVolumes < 2 {
		t.Errorf("TXOUTBOX_NATS_CREDS=%q and %d files from mounted Secrets: want the credentials file and the CA bundle from a Secret volume", vals["TXOUTBOX_NATS_CREDS"], fromVolumes)
	}
	if err := checkMetricsAddr(vals["TXOUTBOX_METRICS_ADDR"]); err != nil || vals["TXOUTBOX_METRICS_ADDR"] == "" {
		t.Fatalf("TXOUTBOX_METRICS_ADDR %q: %v (the probes need it)", vals["TXOUTBOX_METRICS_ADDR"], err)
	}
	_, portText, _ := net.SplitHostPort(vals["TXOUTBOX_METRICS_ADDR"])
	metricsPort, _ := strconv.Atoi(portText)
	portByName := map[string]int{}
	for _, p := range c.Ports {
		portByName[p.Name] = p.ContainerPort
	}
	for _, p := range []struct {
		what, path string
		probe      *k8sProbe
	}{{"liveness", "/healthz", c.LivenessProbe}, {"readiness", "/readyz", c.ReadinessProbe}} {
		if p.probe == nil {
			t.Errorf("no %s probe", p.what)
			continue
		}
		if p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s probe on %q, want %s", p.what, p.probe.HTTPGet.Path, p.path)
		}
		port, err := strconv.Atoi(p.probe.HTTPGet.Port.Value)
		if err != nil {
			port = portByName[p.probe.HTTPGet.Port.Value]
		}
		if port == 0 || port != metricsPort {
			t.Errorf("%s probe on port %q (%d), want the relay's --metrics-addr port %d", p.what, p.probe.HTTPGet.Port.Value, port, metricsPort)
		}
	}
	if g := pod.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= drainBound {
		t.Errorf("terminationGracePeriodSeconds %s, want more than the relay's drain (%s)", fmtPtr(g), drainBound)
	}
	checkSecurity("the Deployment", pod, c)
	if r := dep.Spec.Replicas; r == nil || *r < 2 {
		t.Errorf("replicas %v: run at least two relays (failover)", r)
	}

	// A real API server checks more; where kubectl reaches one, ask it.
	t.Run("kubectl", func(t *testing.T) {
		kubectl, err := exec.LookPath("kubectl")
		if err != nil {
			t.Skip("kubectl is not installed")
		}
		// kustomize needs no server: the kustomization builds, with every object in it.
		out, err := exec.Command(kubectl, "kustomize", dir).CombinedOutput()
		if err != nil {
			t.Fatalf("kubectl kustomize: %v\n%s", err, out)
		}
		for _, kind := range []string{"Secret", "Job", "Deployment", "PodDisruptionBudget"} {
			if !bytes.Contains(out, []byte("\nkind: "+kind+"\n")) {
				t.Errorf("kubectl kustomize output has no %s:\n%s", kind, out)
			}
		}
		if out, err := exec.Command(kubectl, "version", "--request-timeout=3s").CombinedOutput(); err != nil {
			t.Skipf("kubectl reaches no API server (kubectl create --dry-run=client needs one for the resource types): %s", firstLine(out))
		}
		for _, f := range files {
			if f == "kustomization.yaml" {
				continue
			}
			if out, err := exec.Command(kubectl, "create", "--dry-run=client", "-f", filepath.Join(dir, f)).CombinedOutput(); err != nil {
				t.Errorf("kubectl create --dry-run=client -f %s: %v\n%s", f, err, out)
			}
		}
	})
}

// checkLoginName fails when a deploy example logs in as one of the NOLOGIN group roles that
// `relay migrate grants` creates by default (txoutbox_<role>): a URL with it fails with "role
// is not permitted to log in". The examples use login roles granted the group role.
func checkLoginName(t *testing.T, what, user string) {
	t.Helper()
	for _, r := range migrations.Roles {
		if user == "txoutbox_"+r {
			t.Errorf("%s logs in as %s, the NOLOGIN group role `relay migrate grants --role %s` creates: use a login role granted it", what, user, r)
		}
	}
	if user == "" {
		t.Errorf("%s: no user", what)
	}
}

// urlUsers returns the user of each postgres:// URL in text.
func urlUsers(text string) []string {
	var users []string
	for _, m := range regexp.MustCompile(`postgres(?:ql)?://([^:@/\s]+)[:@]`).FindAllStringSubmatch(text, -1) {
		users = append(users, m[1])
	}
	return users
}

func fmtPtr(p *int) string {
	if p == nil {
		return "(unset)"
	}
	return strconv.Itoa(*p)
}

func firstLine(b []byte) string {
	s, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
	return s
}

// The systemd unit runs relay run as a throwaway non-root user with the hardening options,
// stops it with SIGTERM and gives it longer than its drain, restarts it after any exit (a Go
// panic or runtime fatal error exits with status 2, as a configuration error does: with
// RestartPreventExitStatus=2 a crashed relay stayed down) at a bounded rate and without a start
// limit that gives up, sets only variables the relay reads, and passes systemd-analyze verify
// (where it is installed) without a warning.
func TestSystemdUnit(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(deployDir, "systemd")
	unit, err := os.ReadFile(filepath.Join(dir, "relay.service"))
	if err != nil {
		t.Fatal(err)
	}
	runEnv := envNames(t, "run")
	kv := map[string][]string{}
	sc := bufio.NewScanner(bytes.NewReader(unit))
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		if l == "" || l[0] == '#' || l[0] == '[' {
			continue
		}
		k, v, ok := strings.Cut(l, "=")
		if !ok {
			t.Fatalf("not key=value: %q", l)
		}
		kv[k] = append(kv[k], v)
	}
	want := map[string]string{
		"ExecStart": "/usr/local/bin/relay run", "KillSignal": "SIGTERM", "Restart": "always", "StartLimitIntervalSec": "0",
		"DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
		"PrivateDevices": "yes", "CapabilityBoundingSet": "", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
		"MemoryDenyWriteExecute": "yes", "SystemCallFilter": "@system-service",
	}
	for k, v := range want {
		if !slices.Contains(kv[k], v) {
			t.Errorf("%s=%v, want %q", k, kv[k], v)
		}
	}
	for _, k := range []string{"RestartPreventExitStatus", "SuccessExitStatus", "StartLimitBurst", "StartLimitAction"} {
		if len(kv[k]) > 0 {
			t.Errorf("%s=%v: want it unset, or a relay that crashes (a Go panic exits with status 2) may stay down", k, kv[k])
		}
	}
	if every, err := time.ParseDuration(strings.Join(kv["RestartSec"], "") + "s"); err != nil || every < time.Second {
		t.Errorf("RestartSec=%v, want a second or more: a misconfigured relay must not restart in a tight loop", kv["RestartSec"])
	}
	stop, err := time.ParseDuration(strings.Join(kv["TimeoutStopSec"], "") + "s")
	if err != nil || stop <= drainBound {
		t.Errorf("TimeoutStopSec=%v, want more than the relay's drain (%s)", kv["TimeoutStopSec"], drainBound)
	}
	loaded := map[string]string{} // credential name -> the file it is loaded from
	for _, l := range kv["LoadCredential"] {
		name, path, ok := strings.Cut(l, ":")
		if !ok || !strings.HasPrefix(path, "/etc/txoutbox/") {
			t.Errorf("LoadCredential=%s: want NAME:/etc/txoutbox/FILE", l)
		}
		loaded[name] = path
	}
	env := map[string]string{}
	for _, e := range kv["Environment"] {
		name, val, _ := strings.Cut(e, "=")
		if !runEnv[name] {
			t.Errorf("Environment=%s: the relay does not read %s", e, name)
		}
		env[name] = val
		// %d is the credentials directory ($CREDENTIALS_DIRECTORY), what DynamicUser can read.
		if cred, ok := strings.CutPrefix(val, "%d/"); ok && loaded[cred] == "" {
			t.Errorf("Environment=%s: no LoadCredential=%s:…", e, cred)
		}
	}
	for _, name := range []string{"TXOUTBOX_NATS_CREDS", "TXOUTBOX_NATS_TLS_CA"} {
		if !strings.HasPrefix(env[name], "%d/") {
			t.Errorf("Environment=%s=%s: want a file of the credentials directory (%%d/…, LoadCredential=)", name, env[name])
		}
	}
	if !strings.Contains(string(unit), "admin role") {
		t.Error("the unit does not say that relay migrate up runs as the admin role")
	}
	envFile, err := os.ReadFile(filepath.Join(dir, "relay.env"))
	if err != nil {
		t.Fatal(err)
	}
	for what, text := range map[string]string{"relay.service": string(unit), "relay.env": string(envFile)} {
		users := urlUsers(text)
		if len(users) == 0 {
			t.Errorf("%s has no postgres:// URL", what)
		}
		for _, u := range users {
			checkLoginName(t, what, u)
		}
	}
	for _, l := range strings.Split(string(envFile), "\n") {
		if l = strings.TrimSpace(l); l == "" || l[0] == '#' {
			continue
		}
		if name, _, _ := strings.Cut(l, "="); !runEnv[name] {
			t.Errorf("relay.env sets %s, which the relay does not read", name)
		}
	}

	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("systemd-analyze is not installed: the unit was not verified by systemd")
		return
	}
	// Verified as installed, with ExecStart pointing at a real relay binary.
	tmp := t.TempDir()
	text := strings.ReplaceAll(string(unit), "/usr/local/bin/relay", relayBinary(t))
	path := filepath.Join(tmp, "txoutbox-relay.service")
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(analyze, "verify", path).CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
