package relaycli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/txoutbox/txoutbox/internal/embedded"
	"github.com/txoutbox/txoutbox/internal/redact"
	"github.com/txoutbox/txoutbox/migrations"
)

// DefaultNATSURL is used when neither --nats-url nor NATS_URL is set.
const DefaultNATSURL = nats.DefaultURL

// localDSN is where --embedded looks for a running PostgreSQL before starting one.
const localDSN = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// conns are the connections a command uses, plus what to stop on exit.
type conns struct {
	DSN     string
	NATSURL string
	Pool    *pgxpool.Pool
	NC      *nats.Conn
	cleanup []func()
}

func (c *conns) Close() {
	if c.NC != nil {
		// Everything that used the connection has returned: close it before an embedded
		// server goes away under it.
		c.NC.Close()
	}
	if c.Pool != nil {
		c.Pool.Close()
	}
	for i := len(c.cleanup) - 1; i >= 0; i-- {
		c.cleanup[i]()
	}
}

// connectOptions say what a command needs.
type connectOptions struct {
	DSN      string
	NATSURL  string
	NeedNATS bool
	// Embedded starts what is missing: a local or throwaway PostgreSQL when DSN is empty, an
	// in-process nats-server when NATSURL is empty. Development only.
	Embedded bool
	Schema   string
	// Migrate applies migrations (embedded mode does so always).
	Migrate bool
	Log     *slog.Logger
	AppName string
	// Wait makes a daemon that starts while PostgreSQL or NATS does not answer wait for them
	// (saying so once) instead of exiting; a one-shot command fails at once.
	Wait bool
}

func connect(ctx context.Context, o connectOptions) (*conns, error) {
	c := &conns{DSN: o.DSN, NATSURL: o.NATSURL}
	fail := func(err error) (*conns, error) { c.Close(); return nil, err }
	if c.DSN == "" {
		if !o.Embedded {
			return nil, usageErr("no database: set DATABASE_URL (or --database-url), or pass --embedded for local development")
		}
		if embedded.Ping(ctx, localDSN, 2*time.Second) == nil {
			c.DSN = localDSN
			o.Log.Info("embedded mode: using the PostgreSQL running on 127.0.0.1:5432")
		} else {
			o.Log.Info("embedded mode: starting a throwaway PostgreSQL cluster")
			pg, err := embedded.StartPostgres(ctx, embedded.PostgresOptions{})
			if err != nil {
				return fail(err)
			}
			c.cleanup = append(c.cleanup, pg.Stop)
			c.DSN = pg.DSN()
		}
		o.Migrate = true
	}
	pcfg, err := pgxpool.ParseConfig(c.DSN)
	if err != nil {
		return fail(usageErr("invalid DATABASE_URL: %v", err))
	}
	if o.AppName != "" {
		pcfg.ConnConfig.RuntimeParams["application_name"] = o.AppName
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fail(fmt.Errorf("connect to PostgreSQL: %w", err))
	}
	c.Pool = pool
	if o.Migrate {
		m, err := migrations.New(&migrations.Config{Schema: o.Schema})
		if err != nil {
			return fail(err)
		}
		if _, err := m.Up(ctx, pool); err != nil {
			return fail(err)
		}
	}
	if !o.NeedNATS {
		return c, nil
	}
	if c.NATSURL == "" {
		if o.Embedded {
			o.Log.Info("embedded mode: starting an in-process nats-server with JetStream")
			srv, err := embedded.StartNATS(embedded.NATSOptions{})
			if err != nil {
				return fail(err)
			}
			c.cleanup = append(c.cleanup, srv.Shutdown)
			c.NATSURL = srv.URL()
		} else {
			c.NATSURL = DefaultNATSURL
		}
	}
	log := o.Log
	nc, err := nats.Connect(c.NATSURL,
		nats.Name(o.AppName),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250*time.Millisecond),
		nats.RetryOnFailedConnect(true),
		// Publishes fail while the connection is down instead of waiting in a buffer to go out
		// late: the relay retries them itself, and may hand its partitions over meanwhile.
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			subject := ""
			if sub != nil {
				subject = sub.Subject
			}
			log.Warn("nats error", "subject", subject, "err", err)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("nats reconnected", "server", nc.ConnectedUrlRedacted())
		}),
	)
	if err != nil {
		// A URL that does not parse comes back whole in the error: mask its credentials.
		if ue := (*url.Error)(nil); errors.As(err, &ue) {
			ue.URL = redact.DSN(ue.URL)
		}
		return fail(fmt.Errorf("connect to NATS: %w", err))
	}
	c.NC = nc
	if o.Wait {
		if err := waitReady(ctx, c, log); err != nil {
			return fail(err)
		}
	}
	return c, nil
}

// checkNATSURL refuses a NATS URL (or comma-separated list) that does not parse, before
// anything connects; the message masks its credentials.
func checkNATSURL(s string) error {
	for _, u := range strings.Split(s, ",") {
		u = strings.TrimSpace(u)
		if !strings.Contains(u, "://") {
			u = "nats://" + u
		}
		p, err := url.Parse(u)
		if err == nil && p.Hostname() == "" {
			err = errors.New("no host")
		}
		if err != nil {
			if ue := (*url.Error)(nil); errors.As(err, &ue) {
				err = ue.Err
			}
			return usageErr("invalid --nats-url %q: %v", redact.DSN(u), err)
		}
	}
	return nil
}

// errStoppedWaiting is returned when the command is stopped (ctx ends) while it waits for its
// dependencies: a clean stop, exit status 0.
var errStoppedWaiting = errors.New("stopped while waiting for PostgreSQL and NATS")

// waitReady waits until PostgreSQL answers a ping and NATS is connected, or ctx ends. It logs
// one warning per dependency it waits for, and one line when both answer.
func waitReady(ctx context.Context, c *conns, log *slog.Logger) error {
	waited := map[string]bool{}
	delay := 100 * time.Millisecond
	for {
		missing, where := "", ""
		var why error
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := c.Pool.Ping(pctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return errStoppedWaiting
		case err != nil:
			missing, where, why = "PostgreSQL", redact.DSN(c.DSN), err
		case c.NC != nil && !c.NC.IsConnected():
			missing, where, why = "NATS", redact.DSN(c.NATSURL), c.NC.LastError()
		}
		if missing == "" {
			if len(waited) > 0 {
				log.Info("PostgreSQL and NATS answer; starting")
			}
			return nil
		}
		if !waited[missing] {
			waited[missing] = true
			log.Warn("waiting for "+missing+" to answer", "at", where, "err", why)
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return errStoppedWaiting
		case <-t.C:
		}
		delay = min(2*delay, 2*time.Second)
	}
}

// checkSchema refuses to run against a schema that is not migrated to this binary's version.
func checkSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	m, err := migrations.New(&migrations.Config{Schema: schema})
	if err != nil {
		return err
	}
	st, err := m.Status(ctx, pool)
	if err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	v, src := 0, "nothing: no version table of txoutbox, golang-migrate or goose in the schema"
	for _, s := range st {
		if s.Applied {
			v = s.Version
		}
		if s.Source != "" {
			src = s.Source
		}
	}
	if v < m.Latest() {
		return fmt.Errorf("schema %q is at migration version %d (read from %s) but this relay needs %d: run `relay migrate up --schema %s` (or apply migrations/ with your deploy tool)", schema, v, src, m.Latest(), schema)
	}
	return nil
}
