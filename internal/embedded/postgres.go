package embedded

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNoPostgresBinaries means no initdb/pg_ctl was found, so no throwaway cluster can start.
var ErrNoPostgresBinaries = errors.New("no PostgreSQL server binaries (initdb, pg_ctl) found on PATH or under /usr/lib/postgresql/*/bin; " +
	"install them (Debian/Ubuntu: apt-get install postgresql) or set DATABASE_URL to a running PostgreSQL")

// Postgres is a throwaway PostgreSQL cluster in a temporary directory.
type Postgres struct {
	// Dir holds the data directory and the socket; removed by Stop.
	Dir  string
	Port int

	password string
	binDir   string
	cred     *syscall.Credential
}

// PostgresOptions configures StartPostgres.
type PostgresOptions struct {
	// Fsync keeps fsync on (benchmarks want it). Defaults to off: a throwaway cluster need not
	// survive a power cut.
	Fsync bool
	// Log receives progress lines. Defaults to discarding them.
	Log func(format string, args ...any)
	// Password, when set, is user postgres's password, and TCP connections must give it
	// (scram-sha-256); connections over the cluster's Unix socket stay trusted. Defaults to
	// trust for every connection.
	Password string
	// TLS, when set, turns ssl on with these files, and TCP connections must use TLS.
	// Defaults to no TLS.
	TLS *PostgresTLS
}

// PostgresTLS are the server's certificate files (PEM). They are copied into the cluster's
// directory, readable by the server only.
type PostgresTLS struct {
	CertFile, KeyFile string
	// CAFile verifies client certificates (ssl_ca_file). Required with ClientCert.
	CAFile string
	// ClientCert makes TCP connections present a client certificate signed by CAFile whose
	// common name is the user name (pg_hba clientcert=verify-full).
	ClientCert bool
}

// FindPostgresBinaries returns the directory holding initdb and pg_ctl: PATH first, then the
// newest /usr/lib/postgresql/*/bin.
func FindPostgresBinaries() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "pg_ctl")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err != nil {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "pg_ctl")); err != nil {
			continue
		}
		return d, nil
	}
	return "", ErrNoPostgresBinaries
}

func versionOf(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// StartPostgres initialises and starts a cluster on a free port of 127.0.0.1 with trust auth
// (or a password, see PostgresOptions.Password) for user postgres. As root it runs the server
// as the postgres user, which PostgreSQL requires.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	logf := opts.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	bin, err := FindPostgresBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "txoutbox-pg-")
	if err != nil {
		return nil, fmt.Errorf("embedded postgres: %w", err)
	}
	p := &Postgres{Dir: dir, binDir: bin, password: opts.Password}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("embedded postgres: running as root needs a 'postgres' user to run the server as: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		p.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("embedded postgres: %w", err)
		}
	}
	port, err := FreePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	p.Port = port
	data := filepath.Join(dir, "data")
	logf("embedded postgres: initdb in %s (binaries %s)", data, bin)
	initdb := []string{"-D", data, "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-sync"}
	if opts.Password != "" {
		pwfile := filepath.Join(dir, "pwfile")
		if err := os.WriteFile(pwfile, []byte(opts.Password+"\n"), 0o644); err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("embedded postgres: %w", err)
		}
		if p.cred != nil {
			_ = os.Chown(pwfile, int(p.cred.Uid), int(p.cred.Gid))
		}
		initdb = append(initdb, "--auth-host=scram-sha-256", "--pwfile="+pwfile)
		defer os.Remove(pwfile)
	}
	if out, err := p.run(ctx, "initdb", initdb...); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded postgres: initdb: %w\n%s", err, out)
	}
	var sslOpts string
	if opts.TLS != nil {
		if sslOpts, err = p.setupTLS(opts.TLS, opts.Password != ""); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	fsync := "off"
	if opts.Fsync {
		fsync = "on"
	}
	serverOpts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -k %s -c fsync=%s -c max_connections=200 -c shared_buffers=128MB", port, dir, fsync)
	if !opts.Fsync {
		serverOpts += " -c synchronous_commit=off -c full_page_writes=off"
	}
	serverOpts += sslOpts
	logf("embedded postgres: starting on 127.0.0.1:%d", port)
	if out, err := p.run(ctx, "pg_ctl", "-D", data, "-o", serverOpts, "-l", filepath.Join(dir, "server.log"), "-w", "-t", "60", "start"); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "server.log"))
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("embedded postgres: pg_ctl start: %w\n%s\n%s", err, out, log)
	}
	return p, nil
}

// setupTLS copies the certificate files into the cluster directory (owned by the server's
// user, mode 0600), writes a pg_hba.conf that takes TCP connections over TLS only (with a
// client certificate when asked), and returns the server options that turn ssl on.
func (p *Postgres) setupTLS(t *PostgresTLS, password bool) (string, error) {
	if t.CertFile == "" || t.KeyFile == "" || (t.ClientCert && t.CAFile == "") {
		return "", errors.New("embedded postgres: TLS needs CertFile and KeyFile, and CAFile with ClientCert")
	}
	write := func(name string, content []byte) (string, error) {
		path := filepath.Join(p.Dir, name)
		if err := os.WriteFile(path, content, 0o600); err != nil {
			return "", fmt.Errorf("embedded postgres: %w", err)
		}
		if p.cred != nil {
			if err := os.Chown(path, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
				return "", fmt.Errorf("embedded postgres: %w", err)
			}
		}
		return path, nil
	}
	copyFile := func(src, name string) (string, error) {
		b, err := os.ReadFile(src)
		if err != nil {
			return "", fmt.Errorf("embedded postgres: %w", err)
		}
		return write(name, b)
	}
	cert, err := copyFile(t.CertFile, "server.crt")
	if err != nil {
		return "", err
	}
	key, err := copyFile(t.KeyFile, "server.key")
	if err != nil {
		return "", err
	}
	opts := fmt.Sprintf(" -c ssl=on -c ssl_cert_file=%s -c ssl_key_file=%s", cert, key)
	if t.CAFile != "" {
		ca, err := copyFile(t.CAFile, "ca.crt")
		if err != nil {
			return "", err
		}
		opts += " -c ssl_ca_file=" + ca
	}
	method := "trust"
	if password {
		method = "scram-sha-256"
	}
	if t.ClientCert {
		method += " clientcert=verify-full"
	}
	hba := "local all all trust\nhostnossl all all all reject\nhostssl all all all " + method + "\n"
	if _, err := write(filepath.Join("data", "pg_hba.conf"), []byte(hba)); err != nil {
		return "", err
	}
	return opts, nil
}

// DSN is a connection string for the cluster's postgres database (with the password, if the
// cluster has one).
func (p *Postgres) DSN() string {
	u := url.URL{Scheme: "postgres", User: url.User("postgres"), Host: fmt.Sprintf("127.0.0.1:%d", p.Port), Path: "/postgres", RawQuery: "sslmode=disable"}
	if p.password != "" {
		u.User = url.UserPassword("postgres", p.password)
	}
	return u.String()
}

// Stop stops the server immediately and removes its directory.
func (p *Postgres) Stop() {
	if p == nil || p.Dir == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = p.run(ctx, "pg_ctl", "-D", filepath.Join(p.Dir, "data"), "-m", "immediate", "-w", "stop")
	_ = os.RemoveAll(p.Dir)
	p.Dir = ""
}

func (p *Postgres) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(p.binDir, name), args...)
	cmd.Dir = p.Dir
	if p.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	}
	// pg_ctl leaves the server running with our stdout open; use files, not pipes, so that
	// Wait does not block on the server's inherited descriptors.
	var buf bytes.Buffer
	f, err := os.CreateTemp("", "txoutbox-pgctl-")
	if err != nil {
		return nil, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8")
	err = cmd.Run()
	_, _ = f.Seek(0, 0)
	_, _ = buf.ReadFrom(f)
	return buf.Bytes(), err
}

// Ping reports whether a PostgreSQL server answers at dsn within timeout.
func Ping(ctx context.Context, dsn string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = timeout
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}
