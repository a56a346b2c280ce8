package relaycli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/migrations"
)

const grantsUsage = `
relay migrate grants: print the SQL that gives a role what one txoutbox component needs on the
outbox schema, and nothing more (least privilege). It connects to nothing: review the SQL, then
run it (psql -f) as the schema's owner or a superuser, after the migrations and again after a
migration that adds tables.

  producer  insert messages (EnqueueTx, Prepare), settle its half messages (Commit, CommitTx,
            Rollback), cancel and move delayed ones; no DELETE, no payloads read back, no
            dedup rows; row-level security on the outbox table (the grantee joins
            txoutbox_restricted_producers): it changes half messages, delayed messages and
            its transaction's own ready rows only, never another ready, published or dead one
  relay     claim, publish, settle and purge rows, partition leases and membership, schema
            version check, check-back (resolve, stale, purge of dedup rows); --signal-backend
            adds pg_signal_backend, needed to fence a stale relay only when relays log in as
            different roles
  consumer  the dedup and key-order rows (of every consumer of the schema: consumers sharing
            a schema trust each other; --consumers billing,... limits the grantee to the rows
            of those consumer names, with row-level security); nothing of the outbox
  admin     owns the schema and txoutbox's objects in it (its tables, functions, types and
            version tables; the application's and extensions' objects keep their owners):
            migrations up and down, and every admin command

The grantee is created NOLOGIN if it does not exist: grant it to your login roles
(GRANT txoutbox_producer TO orders_service), or name a login role with --grantee.

Usage:
  relay migrate grants --role producer|relay|consumer|admin [--schema S] [--grantee NAME] [--out FILE]
                       [--consumers NAME,...] [--signal-backend]
`

func grantsCmd(_ context.Context, env *Env, args []string) error {
	var role, schema, grantee, out, consumers string
	var signal bool
	s := newSettings("migrate grants", grantsUsage, env.Stderr, env.Getenv)
	s.String(&role, "role", "", "", "producer, relay, consumer or admin")
	s.String(&schema, "schema", "", txoutbox.DefaultSchema, "Postgres schema holding the outbox tables")
	s.String(&grantee, "grantee", "", "", "role to grant to (default txoutbox_<role>)")
	s.Bool(&signal, "signal-backend", "", false, "relay: also grant pg_signal_backend (fencing relays that log in as different roles)")
	s.String(&out, "out", "", "", "write the SQL to this file instead of standard output")
	s.String(&consumers, "consumers", "", "", "consumer: comma-separated consumer (durable) names whose dedup and key-order rows alone the grantee may use (row-level security; default: every consumer's)")
	s.CommandLineOnly("role", "grantee", "signal-backend", "out", "consumers")
	if err := parseSettings(s, env, args); err != nil {
		return err
	}
	if len(s.Args()) > 0 {
		return usageErr("unexpected arguments %q", s.Args())
	}
	if role == "" {
		return usageErr("--role is required: %s", strings.Join(migrations.Roles, ", "))
	}
	if grantee == "" {
		grantee = "txoutbox_" + role
	}
	if signal && role != migrations.RoleRelay {
		return usageErr("--signal-backend is for --role relay")
	}
	var names []string
	for _, n := range strings.Split(consumers, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	if consumers != "" && (role != migrations.RoleConsumer || len(names) == 0) {
		return usageErr("--consumers is for --role consumer, with at least one name")
	}
	sql, err := migrations.Grants(role, schema, grantee, &migrations.GrantOptions{SignalBackend: signal, Consumers: names})
	if errors.Is(err, migrations.ErrUnknownRole) {
		return usageErr("invalid --role %q: want %s", role, strings.Join(migrations.Roles, ", "))
	}
	if err != nil {
		return usageErr("%v", err)
	}
	if out == "" {
		_, err = fmt.Fprint(env.Stdout, sql)
		return err
	}
	if err := os.WriteFile(out, []byte(sql), 0o644); err != nil {
		return err
	}
	fmt.Fprintln(env.Stdout, "wrote", out)
	return nil
}
