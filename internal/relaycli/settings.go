package relaycli

import (
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"
)

// settings is a flag set whose every flag can also come from an environment variable, and
// whose help lists each setting with its variable and default.
type settings struct {
	fs      *flag.FlagSet
	env     map[string]string // flag name -> env var
	order   []string
	usage   string
	section map[string]string // flag name -> section title printed before it
	hidden  map[string]bool
	getenv  func(string) string
}

func newSettings(name, usage string, stderr io.Writer, getenv func(string) string) *settings {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if getenv == nil {
		getenv = os.Getenv
	}
	s := &settings{fs: fs, env: map[string]string{}, usage: usage, section: map[string]string{}, hidden: map[string]bool{}, getenv: getenv}
	return s
}

// envName is TXOUTBOX_ + the flag name in upper snake case, unless given.
func envName(flagName string) string {
	return "TXOUTBOX_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func (s *settings) add(name, env string) {
	if env == "" {
		env = envName(name)
	}
	s.env[name] = env
	s.order = append(s.order, name)
}

// Section starts a titled group in the help output.
func (s *settings) Section(title string) func(name string) {
	return func(name string) { s.section[name] = title }
}

func (s *settings) String(p *string, name, env, def, usage string) {
	s.fs.StringVar(p, name, def, usage)
	s.add(name, env)
}

func (s *settings) Int(p *int, name, env string, def int, usage string) {
	s.fs.IntVar(p, name, def, usage)
	s.add(name, env)
}

func (s *settings) Float(p *float64, name, env string, def float64, usage string) {
	s.fs.Float64Var(p, name, def, usage)
	s.add(name, env)
}

func (s *settings) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	s.fs.DurationVar(p, name, def, usage)
	s.add(name, env)
}

// DurationOr defines a duration setting that also takes word ("off" or "forever"), which
// stores txoutbox's -1 (txoutbox.Off, txoutbox.Forever). Negative durations are refused.
func (s *settings) DurationOr(p *time.Duration, name, env string, def time.Duration, word, usage string) {
	*p = def
	s.fs.Var(durationOr{p: p, word: word}, name, usage)
	s.add(name, env)
}

type durationOr struct {
	p    *time.Duration
	word string
}

func (v durationOr) String() string {
	switch {
	case v.p == nil:
		return ""
	case *v.p == -1:
		return v.word
	}
	return v.p.String()
}

func (v durationOr) Set(s string) error {
	if s == v.word {
		*v.p = -1
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("not a duration or %q", v.word)
	}
	if d < 0 {
		return fmt.Errorf("must not be negative (%q is the word for %s)", v.word, v.word)
	}
	*v.p = d
	return nil
}

func (s *settings) Bool(p *bool, name, env string, def bool, usage string) {
	s.fs.BoolVar(p, name, def, usage)
	s.add(name, env)
}

// CommandLineOnly keeps a setting from being read from the environment: flags that select or
// change data (relay dead --all, --id, ...) must be typed, never inherited.
func (s *settings) CommandLineOnly(names ...string) {
	for _, n := range names {
		s.env[n] = ""
	}
}

// Hide keeps a setting out of the help (test and fault-injection knobs).
func (s *settings) Hide(name string) { s.hidden[name] = true }

// errHelp is returned by parse when --help was asked for.
var errHelp = flag.ErrHelp

// parse reads flags, then fills every flag not given on the command line from its
// environment variable. Errors name the flag (and the variable when the value came from it).
func (s *settings) parse(args []string) error {
	if err := s.fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			return errHelp
		}
		return fmt.Errorf("%v (see --help)", err)
	}
	given := map[string]bool{}
	s.fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	for _, name := range s.order {
		if given[name] {
			continue
		}
		env := s.env[name]
		if env == "" {
			continue
		}
		v := s.getenv(env)
		if v == "" {
			continue
		}
		if err := s.fs.Set(name, v); err != nil {
			return fmt.Errorf("invalid value %q for %s (--%s): %v", v, env, name, err)
		}
	}
	return nil
}

// Args returns the positional arguments left after parse.
func (s *settings) Args() []string { return s.fs.Args() }

// printHelp lists every setting: flag, environment variable, default and meaning.
func (s *settings) printHelp(w io.Writer) {
	fmt.Fprintln(w, strings.TrimSpace(s.usage))
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Settings (flag, environment variable, default):")
	names := append([]string(nil), s.order...)
	// Keep declaration order; sort only for stability when sections are absent.
	if len(s.section) == 0 {
		sort.Strings(names)
	}
	for _, name := range names {
		if s.hidden[name] {
			continue
		}
		if t, ok := s.section[name]; ok {
			fmt.Fprintf(w, "\n  %s\n", t)
		}
		f := s.fs.Lookup(name)
		kind, usage := flag.UnquoteUsage(f)
		def := f.DefValue
		if def == "" {
			def = `""`
		}
		left := "--" + name
		if kind != "" {
			left += " " + kind
		}
		fmt.Fprintf(w, "    %-30s %s\n", left, usage)
		if env := s.env[name]; env != "" {
			fmt.Fprintf(w, "    %-30s env %s, default %s\n", "", env, def)
		} else {
			fmt.Fprintf(w, "    %-30s command line only, default %s\n", "", def)
		}
	}
}
