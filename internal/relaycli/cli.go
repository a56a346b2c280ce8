// Package relaycli implements the relay command: the daemon (`relay run`) and its admin
// subcommands. cmd/relay/main.go only calls Main.
package relaycli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// Env is the process environment the CLI runs in; tests substitute their own.
type Env struct {
	Stdout io.Writer
	Stderr io.Writer
	Getenv func(string) string
}

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, env *Env, args []string) error
}

// commands is the subcommand table; subcommands register themselves in init functions of
// their own files.
var commands []command

func register(c command) { commands = append(commands, c) }

const mainUsage = `relay: publishes txoutbox outbox rows to NATS JetStream, and administers the outbox.

Usage:
  relay <command> [settings]

Commands:
%s
Every command takes --help, which lists each of its settings with its environment variable
and default. relay --version is relay version.
`

// ErrUsage marks errors in how the command was invoked (exit status 2).
var ErrUsage = errors.New("usage")

// Main runs the relay command with args (without the program name) and returns the exit
// status: 0 on success, 1 on failure, 2 on bad usage or configuration.
func Main(ctx context.Context, args []string, env *Env) int {
	if env == nil {
		env = &Env{}
	}
	if env.Stdout == nil {
		env.Stdout = os.Stdout
	}
	if env.Stderr == nil {
		env.Stderr = os.Stderr
	}
	if env.Getenv == nil {
		env.Getenv = os.Getenv
	}
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		printMainUsage(env.Stdout)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	if args[0] == "--version" || args[0] == "-version" {
		args = append([]string{"version"}, args[1:]...)
	}
	for _, c := range commands {
		if c.name != args[0] {
			continue
		}
		err := c.run(ctx, env, args[1:])
		switch {
		case err == nil:
			return 0
		case errors.Is(err, errHelp), errors.Is(err, errStoppedWaiting):
			return 0
		case errors.Is(err, ErrUsage):
			fmt.Fprintf(env.Stderr, "relay %s: %v\n", c.name, err)
			return 2
		default:
			fmt.Fprintf(env.Stderr, "relay %s: %v\n", c.name, err)
			return 1
		}
	}
	fmt.Fprintf(env.Stderr, "relay: unknown command %q\n\n", args[0])
	printMainUsage(env.Stderr)
	return 2
}

func printMainUsage(w io.Writer) {
	var b strings.Builder
	for _, c := range commands {
		fmt.Fprintf(&b, "  %-12s %s\n", c.name, c.summary)
	}
	fmt.Fprintf(w, mainUsage, b.String())
}

// usageError is a usage or configuration error; errors.Is(err, ErrUsage) holds.
type usageError struct{ msg string }

func (e *usageError) Error() string        { return e.msg }
func (e *usageError) Is(target error) bool { return target == ErrUsage }

// usageErr returns a usage error (exit status 2).
func usageErr(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// parseSettings parses args, printing help on --help.
func parseSettings(s *settings, env *Env, args []string) error {
	s.getenv = env.Getenv
	err := s.parse(args)
	if errors.Is(err, errHelp) {
		s.printHelp(env.Stdout)
		return errHelp
	}
	if err != nil {
		return usageErr("%v", err)
	}
	return nil
}

// newLogger builds the slog logger --log-format and --log-level ask for.
func newLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, usageErr("invalid --log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, usageErr("invalid --log-format %q: want text or json", format)
}
