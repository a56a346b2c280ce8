// Package txoutbox holds what every txoutbox package shares: the database handle interfaces,
// the configuration conventions and the default schema.
//
// The roles live in their own packages: outbox (producers write messages in their own
// transaction), outbox/checker (a producer group's answer to the check-back: did this half
// message's transaction commit?), relay (publishes committed messages to NATS JetStream),
// consumer (idempotent JetStream consumers), checkback (resolves stale half messages and
// purges old rows) and migrations (the schema).
//
// # Database handles
//
// Every package takes one of three interfaces, the narrowest that does its job: DBTX when it
// runs statements on what it is given (in the caller's transaction, when given a pgx.Tx),
// Beginner when it runs a transaction of its own, and DB when it does both. pgx.Tx, *pgx.Conn,
// *pgxpool.Pool and *pgxpool.Conn satisfy all three (Begin on a pgx.Tx starts a savepoint).
// The relay alone takes a *pgxpool.Pool: it holds dedicated sessions (its partition leases are
// session advisory locks).
//
// Services on database/sql use the database/sql counterparts SQLDBTX, SQLBeginner and SQLDB
// (*sql.Tx, *sql.Conn, *sql.DB, sqlx, GORM's connection pool; any PostgreSQL driver), taken by
// the producer methods whose names say SQL: outbox.Client.EnqueueSQLTx, the half-message twins
// (PrepareSQL, CommitSQL, CommitSQLTx, RollbackSQL, SendInTransactionSQL), the delayed
// messages' twins (CancelSQLTx, RescheduleSQLTx, CancelBizKeySQLTx, RescheduleBizKeySQLTx) and
// checker.OutboxIdentitySQL. consumer.NewSQL alone takes a *sql.DB itself, not an interface: it
// takes a connection of its own (sql.DB.Conn) for each message, so that after a failed commit
// it can ask that same connection whether it is alive.
//
// # Configuration
//
// Every component is built from a Config struct, with a WithDefaults method and a
// ValidateConfig function beside it. In every Config:
//   - a zero value means the default, which the field's documentation states ("Defaults to
//     100."); Config.WithDefaults returns a copy with the defaults applied. An exported
//     Default… constant holds each default, in the field's package except for every
//     Config.Schema, whose default is this package's DefaultSchema; the defaults derived
//     from other values have no constant, and the field's documentation gives their
//     computation instead:
//     relay.Config.ID (hostname:pid), consumer.Config.DeadLetterSubject
//     (DefaultDeadLetterPrefix + Durable), InProgressInterval (AckWait/3), PullMaxMessages
//     (from Concurrency and BatchSize) and StopTimeout (AckWait), checkback.Config.Outbox (the
//     database's identity), relay.Config.PollMax (its default, or PollMin when that is
//     larger), every BackoffMax (its default, or BackoffBase when that is larger), the Logger
//     fields (slog.Default), and the TracerProvider and Propagator fields (OpenTelemetry's
//     global provider and propagator, which WithDefaults leaves nil: the constructor takes
//     them);
//   - Off (-1) turns a feature off and Forever (-1) lifts a limit, only for the fields whose
//     documentation names them: every BackoffJitter (off), relay.Config.HandoverAfter (off),
//     MaxMessageBytes (off: no size check of its own) and PublishedRetention (forever),
//     checkback.Config.TransactionTimeout (off), GroupRate and the three retentions (forever),
//     consumer.Config.StopTimeout (forever). Every other field refuses -1 with the rest of the
//     negative values: no other count takes it (relay.Config.MaxAttempts,
//     consumer.Config.MaxDeliveries and MaxAckPending, checkback.Config.MaxChecks, the batch
//     sizes and concurrencies have no off or forever value). Settings that are not numbers
//     have no -1: an optional feature that is off by default is turned on by setting it
//     (relay.Config.DoorbellChannel, "" is off), one that is on by default is turned off by
//     a Disable… field (relay.Config.DisableDoorbell), and a job by its schedule
//     (checkback.ScheduleOff);
//   - an invalid value is reported, before anything runs, as a *ConfigError naming the field,
//     which matches ErrInvalidConfig with errors.Is.
package txoutbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultSchema is the PostgreSQL schema every package uses when Config.Schema is empty.
const DefaultSchema = "public"

// Off and Forever are the values that turn a Config field off or make it unbounded, for the
// fields whose documentation says so (see the package documentation for the list): a factor,
// a rate, a size or a duration set to -1. They are untyped, so they fit int, float64 and
// time.Duration values alike (migrations.DownAll is Forever as a number of steps).
const (
	Off     = -1
	Forever = -1
)

// ErrInvalidConfig is matched (errors.Is) by every *ConfigError.
var ErrInvalidConfig = errors.New("txoutbox: invalid configuration")

// ErrRunning is returned by the Run method of a relay, consumer or check-back that is already
// running. Once Run has returned, it may be called again.
var ErrRunning = errors.New("txoutbox: already running")

// ConfigError reports an invalid configuration value and names it.
type ConfigError struct {
	// Package is the package whose configuration is invalid, such as "relay".
	Package string
	// Field is the invalid field, such as "Config.BatchSize".
	Field string
	// Reason says what is wrong and what is accepted.
	Reason string
	// Err is the error behind Reason when there is one, such as a validation sentinel of
	// package outbox: errors.Is and errors.As see it.
	Err error
}

func (e *ConfigError) Error() string { return e.Package + ": " + e.Field + " " + e.Reason }

// Is reports whether target is ErrInvalidConfig.
func (e *ConfigError) Is(target error) bool { return target == ErrInvalidConfig }

// Unwrap returns Err.
func (e *ConfigError) Unwrap() error { return e.Err }

// DBTX runs statements: pgx.Tx, *pgx.Conn, *pgxpool.Pool and *pgxpool.Conn satisfy it. A call
// given a pgx.Tx runs its statements in that transaction.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// Beginner begins transactions (on a pgx.Tx, savepoints): *pgxpool.Pool, *pgx.Conn,
// *pgxpool.Conn and pgx.Tx satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// DB runs statements and begins transactions: usually a *pgxpool.Pool.
type DB interface {
	DBTX
	Beginner
}

// ErrServerTooOld is matched (errors.Is) by every *ServerVersionError: the relay, the consumer
// and the check-back refuse, before doing anything, a nats-server older than they need
// (relay.MinServerVersion, consumer.MinServerVersion, checkback.MinServerVersion).
var ErrServerTooOld = errors.New("txoutbox: nats-server too old")

// ServerVersionError is a nats-server older than a feature needs. errors.Is(err,
// ErrServerTooOld) holds.
type ServerVersionError struct {
	// Component is the package or command that refused the server (relay, consumer, checkback).
	Component string
	// Feature is what needs the version, in plain words.
	Feature string
	// Server is the version the server announced in its INFO; Required the oldest that works.
	Server   string
	Required string
}

func (e *ServerVersionError) Error() string {
	return fmt.Sprintf("%s: nats-server %s is too old: %s needs nats-server %s or later", e.Component, e.Server, e.Feature, e.Required)
}

// Is reports ErrServerTooOld.
func (e *ServerVersionError) Is(target error) bool { return target == ErrServerTooOld }
