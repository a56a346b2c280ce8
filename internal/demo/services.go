package demo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/migrations"
)

// services are the PostgreSQL and NATS the demo runs against, and what to stop on exit.
type services struct {
	DSN     string
	NATSURL string
	// NATS is the embedded server (nil when NATS_URL points elsewhere).
	NATS *embedded.NATS
	// Described says where each came from, for the first lines of the output.
	PostgresFrom, NATSFrom string

	pg *embedded.Postgres
	// keep leaves the throwaway cluster running at Close (-keep), saying how to stop it.
	keep bool
	log  func(format string, args ...any)
}

type serviceOptions struct {
	// DSN is the PostgreSQL to use; "" starts a throwaway cluster. A PostgreSQL that merely
	// happens to run on this machine is never written into: nobody named it.
	DSN     string
	NATSURL string // "" = an embedded nats-server
	NoNATS  bool   // the caller starts NATS itself
	Keep    bool   // leave a throwaway cluster running at exit
	Log     func(format string, args ...any)
}

// startServices finds or starts PostgreSQL and NATS.
func startServices(ctx context.Context, o serviceOptions) (*services, error) {
	s := &services{DSN: o.DSN, NATSURL: o.NATSURL, keep: o.Keep, log: o.Log}
	switch {
	case s.DSN != "":
		if err := embedded.Ping(ctx, s.DSN, 5*time.Second); err != nil {
			return nil, fmt.Errorf("DATABASE_URL is set but PostgreSQL does not answer there: %w", err)
		}
		s.PostgresFrom = "DATABASE_URL (" + redact.DSN(s.DSN) + ")"
	default:
		_, err := embedded.FindPostgresBinaries()
		if err == nil {
			o.Log("no DATABASE_URL: starting a throwaway PostgreSQL cluster from the local binaries (a PostgreSQL already running here is left alone) …")
			var pg *embedded.Postgres
			if pg, err = embedded.StartPostgres(ctx, embedded.PostgresOptions{}); err == nil {
				s.pg = pg
			}
		}
		if errors.Is(err, embedded.ErrNoPostgresBinaries) {
			return nil, fmt.Errorf("no DATABASE_URL, and no PostgreSQL binaries to start a throwaway cluster.\n"+
				"  Either set DATABASE_URL to a PostgreSQL you can create schemas in, e.g.\n"+
				"    DATABASE_URL=postgres://user:pass@host:5432/db go run ./cmd/producer-demo\n"+
				"  or install the PostgreSQL server binaries (initdb, pg_ctl) so the demo can start a throwaway cluster:\n"+
				"    Debian/Ubuntu: apt-get install postgresql    Fedora: dnf install postgresql-server    macOS: brew install postgresql\n"+
				"  (%w)", err)
		}
		if err != nil {
			return nil, err
		}
		s.DSN = s.pg.DSN()
		if o.Keep {
			s.PostgresFrom = fmt.Sprintf("a throwaway cluster on 127.0.0.1:%d in %s (kept running at exit: -keep)", s.pg.Port, s.pg.Dir)
		} else {
			s.PostgresFrom = fmt.Sprintf("a throwaway cluster on 127.0.0.1:%d in %s (removed at exit)", s.pg.Port, s.pg.Dir)
		}
	}
	if o.NoNATS {
		return s, nil
	}
	if s.NATSURL == "" {
		n, err := embedded.StartNATS(embedded.NATSOptions{})
		if err != nil {
			s.Close()
			return nil, err
		}
		s.NATS = n
		s.NATSURL = n.URL()
		s.NATSFrom = fmt.Sprintf("an embedded nats-server with JetStream on %s, store %s (removed at exit)", redact.NATS(n.URL()), n.StoreDir)
	} else {
		s.NATSFrom = "NATS_URL (" + redact.NATS(s.NATSURL) + ")"
	}
	return s, nil
}

// Close stops what startServices started.
func (s *services) Close() {
	if s.NATS != nil {
		s.NATS.Shutdown()
		s.NATS = nil
	}
	if s.pg != nil {
		if s.keep {
			if s.log != nil {
				s.log("The throwaway PostgreSQL cluster is kept running (-keep): psql %q; when done: pg_ctl -D %s stop (as the user it runs as), then rm -rf %s",
					s.pg.DSN(), filepath.Join(s.pg.Dir, "data"), s.pg.Dir)
			}
		} else {
			s.pg.Stop()
		}
		s.pg = nil
	}
}

func randomSuffix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// newPool connects to dsn with search_path set to schema (so the demo's business tables,
// which it creates there, need no qualification) and the given application_name, by which the
// chaos run finds the backends it terminates.
func newPool(ctx context.Context, dsn, schema, appName string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("invalid DATABASE_URL: %w", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.ConnConfig.RuntimeParams["application_name"] = appName
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

// createSchema migrates a new schema and creates the business tables in it.
func createSchema(ctx context.Context, db *pgxpool.Pool, schema string, setup *businessSetup) error {
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx, db); err != nil {
		return fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, businessDDL); err != nil {
		return fmt.Errorf("create the business tables: %w", err)
	}
	if err := setup.seed(ctx, tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func dropSchema(ctx context.Context, db *pgxpool.Pool, schema string) error {
	_, err := db.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	return err
}

// connectNATS connects the way a long-running service should: reconnect forever, quickly.
func connectNATS(url, name string) (*nats.Conn, error) {
	return nats.Connect(url,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond),
		nats.RetryOnFailedConnect(true),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}),
	)
}
