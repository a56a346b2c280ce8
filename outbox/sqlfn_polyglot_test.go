package outbox_test

import (
	"context"
	"encoding/json"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/testsvc"
)

// The README's snippets for Python (psycopg 3), Java (JDBC) and Node (node-postgres) are the
// code between "snippet:<language>" and "snippet:end" in these programs, which the tests below
// run against a migrated schema where the client can be had (.ci/run installs them: Debian's
// python3-psycopg and libpostgresql-jdbc-java, and npm ci in testdata/polyglot/node).
var polyglotPrograms = []struct{ lang, path string }{
	{"python", "testdata/polyglot/producer.py"},
	{"java", "testdata/polyglot/Producer.java"},
	{"node", "testdata/polyglot/node/producer.js"},
}

// snippet returns the lines of the program at path between its "snippet:<lang>" and
// "snippet:end" marker lines.
func snippet(t *testing.T, lang, path string) string {
	t.Helper()
	src, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	in := false
	for _, line := range strings.Split(string(src), "\n") {
		switch {
		case strings.HasSuffix(strings.TrimSpace(line), "snippet:"+lang):
			in = true
		case strings.HasSuffix(strings.TrimSpace(line), "snippet:end"):
			if !in {
				t.Fatalf("%s: snippet:end before snippet:%s", path, lang)
			}
			return strings.Join(out, "\n") + "\n"
		case in:
			out = append(out, line)
		}
	}
	t.Fatalf("%s: no snippet:%s ... snippet:end", path, lang)
	return ""
}

// The README shows each program's snippet as it is, so that what readers copy is what runs.
func TestSQLProducerSnippetsInREADME(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range polyglotPrograms {
		if s := snippet(t, p.lang, p.path); !strings.Contains(string(readme), s) {
			t.Errorf("README.md does not hold the %s snippet of %s verbatim:\n%s", p.lang, p.path, s)
		}
	}
}

// polyglotDB is a migrated schema with the business table the programs update.
func polyglotDB(t *testing.T) (*testsvc.DB, *url.URL) {
	t.Helper()
	db := testsvc.NewDB(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL);
INSERT INTO orders VALUES (42, 'new'), (7, 'new')`); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(testsvc.PostgresDSN(t))
	if err != nil {
		t.Fatal(err)
	}
	return db, u
}

// libpqEnv is the environment libpq-style clients (psycopg, node-postgres) connect with: the
// tests' server, with the schema on the search_path.
func libpqEnv(u *url.URL, schema string) []string {
	env := append(os.Environ(), "PGHOST="+u.Hostname(), "PGPORT="+cmpOr(u.Port(), "5432"),
		"PGUSER="+u.User.Username(), "PGDATABASE="+strings.TrimPrefix(u.Path, "/"),
		"PGOPTIONS=-c search_path="+schema)
	if pw, ok := u.User.Password(); ok {
		env = append(env, "PGPASSWORD="+pw)
	}
	if m := u.Query().Get("sslmode"); m != "" {
		env = append(env, "PGSSLMODE="+m)
	}
	return env
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// runProgram runs cmd (in dir) and returns its standard output; it fails the test, with the
// output, when the program fails.
func runProgram(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	// Generous: a JVM compiling a source file on a loaded machine takes a while.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, env
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\nstdout:\n%s\nstderr:\n%s", name, strings.Join(args, " "), err, out, stderr.String())
	}
	t.Logf("%s: stderr:\n%s", name, stderr.String())
	return string(out)
}

// checkProducerRun checks what a program printed and wrote: the order's event with its key,
// headers and business key in the transaction that marked it created; three shipped events
// in order from one call; a half message committed with the payment; TX001 for a bad
// subject, raised and caught; nothing else written.
func checkProducerRun(t *testing.T, db *testsvc.DB, out string) {
	t.Helper()
	ctx := context.Background()
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(line), " ")
		got[k] = v
	}
	t.Logf("program output: %v", got)
	type row struct {
		id        int64
		subject   string
		key       string
		headers   map[string][]string
		order     int
		state     string
		partition int32
	}
	read := func(s string) row {
		t.Helper()
		id, err := uuid.Parse(s)
		if err != nil {
			t.Fatalf("message id %q: %v (output %v)", s, err, got)
		}
		var r row
		var hdr, payload []byte
		if err := db.Pool.QueryRow(ctx, `SELECT id, subject, coalesce(msg_key, ''), headers, payload, state, partition_key FROM txoutbox_messages WHERE message_id = $1`, id).
			Scan(&r.id, &r.subject, &r.key, &hdr, &payload, &r.state, &r.partition); err != nil {
			t.Fatalf("message %s: %v", id, err)
		}
		if hdr != nil {
			if err := json.Unmarshal(hdr, &r.headers); err != nil {
				t.Fatal(err)
			}
		}
		var p struct{ Order int }
		if err := json.Unmarshal(payload, &p); err != nil {
			t.Fatalf("message %s: payload %q: %v", id, payload, err)
		}
		r.order = p.Order
		return r
	}
	status := func(order int) string {
		var s string
		if err := db.Pool.QueryRow(ctx, `SELECT status FROM orders WHERE id = $1`, order).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	created := read(got["enqueued"])
	if created.subject != "orders.created" || created.key != "order-42" || created.order != 42 || created.state != "ready" ||
		strings.Join(created.headers["traceparent"], ",") != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" ||
		strings.Join(created.headers["Txoutbox-Biz-Key"], ",") != "order:42:created" || len(created.headers) != 2 {
		t.Errorf("enqueued message: %+v", created)
	}
	if s := status(42); s != "created" {
		t.Errorf("order 42 is %q, want created (the business change commits with the message)", s)
	}
	shipped := strings.Split(got["many"], ",")
	if len(shipped) != 3 {
		t.Fatalf("enqueue many: %q, want 3 ids", got["many"])
	}
	var last int64
	for i, s := range shipped {
		r := read(s)
		if r.subject != "orders.shipped" || r.key != "order-"+strconv.Itoa(i+1) || r.order != i+1 || r.state != "ready" || r.headers != nil {
			t.Errorf("shipped message %d: %+v", i+1, r)
		}
		if r.id <= last {
			t.Errorf("shipped message %d has row id %d, not after %d: the batch must keep its order", i+1, r.id, last)
		}
		last = r.id
	}
	paid := read(got["half"])
	if paid.subject != "orders.paid" || paid.key != "order-7" || paid.order != 7 || paid.state != "ready" {
		t.Errorf("half message after txoutbox_commit_in_tx: %+v", paid)
	}
	if s := status(7); s != "paid" {
		t.Errorf("order 7 is %q, want paid", s)
	}
	if got["refused"] != "TX001" {
		t.Errorf("bad subject: the program caught %q, want SQLSTATE TX001", got["refused"])
	}
	if v := got["try_enqueue"]; v != "None" && v != "null" {
		t.Errorf("try_enqueue of a wildcard subject returned %q, want no id", v)
	}
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM txoutbox_messages`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 5 {
		t.Errorf("%d messages in the outbox, want 5 (the refused ones never written)", n)
	}
}

// producer.py through Python's psycopg 3 (Debian: python3-psycopg).
func TestSQLProducerPython(t *testing.T) {
	t.Parallel()
	var python string
	for _, cand := range []string{"python3", "/usr/bin/python3"} {
		p, err := exec.LookPath(cand)
		if err != nil {
			continue
		}
		if exec.Command(p, "-c", "import psycopg").Run() == nil {
			python = p
			break
		}
	}
	if python == "" {
		t.Skip("no python3 with psycopg 3 on this machine (Debian: apt-get install python3-psycopg; .ci/run does)")
	}
	db, u := polyglotDB(t)
	abs, err := filepath.Abs("testdata/polyglot")
	if err != nil {
		t.Fatal(err)
	}
	out := runProgram(t, abs, libpqEnv(u, db.Schema), python, "producer.py")
	checkProducerRun(t, db, out)
}

// Producer.java through PostgreSQL's JDBC driver (Debian: libpostgresql-jdbc-java), run as a
// single source file (java 11 or later).
func TestSQLProducerJava(t *testing.T) {
	t.Parallel()
	java, err := exec.LookPath("java")
	if err != nil {
		t.Skip("no java on this machine (Debian: apt-get install default-jdk-headless)")
	}
	const jar = "/usr/share/java/postgresql.jar"
	if _, err := os.Stat(jar); err != nil {
		t.Skipf("no PostgreSQL JDBC driver at %s (Debian: apt-get install libpostgresql-jdbc-java; .ci/run does)", jar)
	}
	db, u := polyglotDB(t)
	q := url.Values{}
	q.Set("user", u.User.Username())
	if pw, ok := u.User.Password(); ok {
		q.Set("password", pw)
	}
	if m := u.Query().Get("sslmode"); m != "" {
		q.Set("sslmode", m)
	}
	q.Set("currentSchema", db.Schema)
	jdbcURL := "jdbc:postgresql://" + u.Hostname() + ":" + cmpOr(u.Port(), "5432") + u.Path + "?" + q.Encode()
	abs, err := filepath.Abs("testdata/polyglot")
	if err != nil {
		t.Fatal(err)
	}
	out := runProgram(t, abs, append(os.Environ(), "TXOUTBOX_JDBC_URL="+jdbcURL), java, "-cp", jar, "Producer.java")
	checkProducerRun(t, db, out)
}

// producer.js through node-postgres (npm ci in testdata/polyglot/node installs the locked pg).
func TestSQLProducerNode(t *testing.T) {
	t.Parallel()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("no node on this machine")
	}
	abs, err := filepath.Abs("testdata/polyglot/node")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(abs, "node_modules", "pg", "package.json")); err != nil {
		t.Skip("node-postgres is not installed: run npm ci in outbox/testdata/polyglot/node (.ci/run does)")
	}
	db, u := polyglotDB(t)
	out := runProgram(t, abs, libpqEnv(u, db.Schema), node, "producer.js")
	checkProducerRun(t, db, out)
}
