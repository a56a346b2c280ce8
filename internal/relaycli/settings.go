package relaycli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
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

// Duration defines a duration setting without an off or forever value: a negative value,
// or -1, is refused when the flag is parsed, saying so.
func (s *settings) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	*p = def
	s.fs.Var(durationValue{p: p}, name, usage)
	s.add(name, env)
}

type durationValue struct{ p *time.Duration }

func (v durationValue) String() string {
	if v.p == nil {
		return ""
	}
	return v.p.String()
}

func (v durationValue) Set(s string) error {
	d, err := time.ParseDuration(s)
	switch {
	case s == "-1" || (err == nil && d < 0):
		return errors.New("must not be negative (this setting has no off or forever)")
	case err != nil:
		return errors.New("not a duration (a number with a unit: 500ms, 30s, 1h30m)")
	}
	*v.p = d
	return nil
}

// DurationOr defines a duration setting whose library field takes txoutbox.Off or
// txoutbox.Forever: it also takes word ("off" or "forever", as the field's documentation
// names it) and -1, both of which store -1. Other negative durations are refused.
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
	if s == v.word || s == "-1" {
		*v.p = -1
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("not a duration, %s or -1", v.word)
	}
	if d < 0 {
		return fmt.Errorf("must not be negative (%s, or -1, is the word for %s)", v.word, v.word)
	}
	*v.p = d
	return nil
}

// IntOr is DurationOr for a whole number: it takes a number, word or -1 (both store -1);
// other negative numbers are refused.
func (s *settings) IntOr(p *int, name, env string, def int, word, usage string) {
	*p = def
	s.fs.Var(intOr{p: p, word: word}, name, usage)
	s.add(name, env)
}

type intOr struct {
	p    *int
	word string
}

func (v intOr) String() string {
	switch {
	case v.p == nil:
		return ""
	case *v.p == -1:
		return v.word
	}
	return strconv.Itoa(*v.p)
}

func (v intOr) Set(s string) error {
	if s == v.word || s == "-1" {
		*v.p = -1
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return fmt.Errorf("not a whole number, %s or -1", v.word)
	}
	if n < 0 {
		return fmt.Errorf("must not be negative (%s, or -1, is the word for %s)", v.word, v.word)
	}
	*v.p = n
	return nil
}

// FloatOr is DurationOr for a number: it takes a number, word or -1 (both store -1); other
// negative numbers are refused.
func (s *settings) FloatOr(p *float64, name, env string, def float64, word, usage string) {
	*p = def
	s.fs.Var(floatOr{p: p, word: word}, name, usage)
	s.add(name, env)
}

type floatOr struct {
	p    *float64
	word string
}

func (v floatOr) String() string {
	switch {
	case v.p == nil:
		return ""
	case *v.p == -1:
		return v.word
	}
	return strconv.FormatFloat(*v.p, 'g', -1, 64)
}

func (v floatOr) Set(s string) error {
	if s == v.word || s == "-1" {
		*v.p = -1
		return nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return fmt.Errorf("not a number, %s or -1", v.word)
	}
	if f < 0 {
		return fmt.Errorf("must not be negative (%s, or -1, is the word for %s)", v.word, v.word)
	}
	*v.p = f
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

// EnvironmentOnlyFor makes every setting defined so far command-line only except names: the
// admin commands that select or change rows (dead, prepared) read only where the outbox is
// (--database-url, --schema) from the environment, never what to select or change, so a stray
// TXOUTBOX_ALL=true can widen nothing. Call it after the last setting is defined.
func (s *settings) EnvironmentOnlyFor(names ...string) {
	keep := map[string]bool{}
	for _, n := range names {
		keep[n] = true
	}
	for _, n := range s.order {
		if !keep[n] {
			s.env[n] = ""
		}
	}
}

// parseInterleaved parses settings that may come before, between or after positional
// arguments, and returns the positional arguments.
func parseInterleaved(s *settings, env *Env, args []string) ([]string, error) {
	var positional []string
	for rest := args; ; {
		if err := parseSettings(s, env, rest); err != nil {
			return nil, err
		}
		if len(s.Args()) == 0 {
			return positional, nil
		}
		positional = append(positional, s.Args()[0])
		rest = s.Args()[1:]
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
		if len(left) > 30 { // the description on a line of its own, aligned with the others
			fmt.Fprintf(w, "    %s\n", left)
			left = ""
		}
		fmt.Fprintf(w, "    %-30s %s\n", left, usage)
		if env := s.env[name]; env != "" {
			fmt.Fprintf(w, "    %-30s env %s, default %s\n", "", env, def)
		} else {
			fmt.Fprintf(w, "    %-30s command line only, default %s\n", "", def)
		}
	}
}
