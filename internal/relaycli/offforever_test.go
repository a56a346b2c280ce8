package relaycli

import (
	"cmp"
	"context"
	"io"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/relay"
)

// offForeverFlags is the one rule's table: every flag whose library field takes txoutbox.Off
// or txoutbox.Forever (-1), by command, with the word of the field's documentation.
var offForeverFlags = map[string]map[string]string{
	"run": {
		"backoff-jitter": "off", "handover-after": "off", "retention": "forever",
		"check-transaction-timeout": "off", "check-backoff-jitter": "off", "check-group-rate": "forever",
		"rolled-back-retention": "forever", "dedup-retention": "forever", "max-message-bytes": "off",
	},
	"checkback": {
		"check-transaction-timeout": "off", "check-backoff-jitter": "off", "check-group-rate": "forever",
		"retention": "forever", "rolled-back-retention": "forever", "dedup-retention": "forever",
	},
}

// parseFlag parses `relay <command> --<flag> <value>` as the command does (its literal-zero
// rules included) and returns the value of the library field the flag sets.
func parseFlag(t *testing.T, command, flagName, value string) (float64, error) {
	t.Helper()
	env := &Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(string) string { return "" }}
	s := newSettings(command, "", io.Discard, env.Getenv)
	var f runFlags
	var cfg any
	switch command {
	case "run":
		defineRunFlags(s, &f)
	case "checkback":
		defineCheckbackFlags(s, &f.cb, true)
	}
	if err := parseSettings(s, env, []string{"--" + flagName, value}); err != nil {
		return 0, err
	}
	field := ""
	switch {
	case command == "run" && !slices.Contains(mapValues(checkbackFieldFlags), flagName) || flagName == "retention" && command == "run":
		f.literalZeros()
		if err := relay.ValidateConfig(&f.cfg); err != nil {
			return 0, err
		}
		cfg, field = &f.cfg, fieldOf(fieldFlags, flagName)
	default:
		if command == "run" { // as run does: the check-back purges by the relay's retention
			f.cb.PublishedRetention = cmp.Or(f.cfg.PublishedRetention, txoutbox.Forever)
		}
		if err := checkCheckbackFlags(&f.cb); err != nil {
			return 0, err
		}
		cfg, field = &f.cb, fieldOf(checkbackFieldFlags, flagName)
	}
	v := reflect.ValueOf(cfg).Elem().FieldByName(field)
	if v.CanFloat() {
		return v.Float(), nil
	}
	return float64(v.Int()), nil
}

func mapValues(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

func fieldOf(m map[string]string, flagName string) string {
	for field, f := range m {
		if f == flagName {
			return field
		}
	}
	return ""
}

// takesMinusOne lists the flags (of fieldFlags or checkbackFieldFlags) whose library field
// accepts -1, found by validating -1 in each numeric field of the Config; a field taking -1
// that no flag sets fails the test.
func takesMinusOne(t *testing.T, cfg any, validate func() error, flags map[string]string) []string {
	var out []string
	typ := reflect.TypeOf(cfg).Elem()
	for i := 0; i < typ.NumField(); i++ {
		field := typ.Field(i).Name
		v := reflect.ValueOf(cfg).Elem().Field(i)
		if !typ.Field(i).IsExported() {
			continue
		}
		flagName, ok := flags[field]
		old := reflect.ValueOf(v.Interface())
		switch {
		case v.CanFloat():
			v.SetFloat(-1)
		case v.CanInt():
			v.SetInt(-1)
		default:
			continue
		}
		if validate() == nil {
			if !ok {
				t.Errorf("%s.%s takes -1, and no flag sets it (add it to the field-to-flag map)", typ, field)
			}
			out = append(out, flagName)
		}
		v.Set(old)
	}
	slices.Sort(out)
	return out
}

// One rule on the command line for off and forever: every flag whose library field takes -1
// takes -1 and the word its documentation uses (off or forever), and both set the field to
// -1. Every 0 is literal: none where a zero means none (the jitters, the check-back's wait),
// run's --retention 0 deletes published rows at once and checkback's --retention 0 keeps none
// either (every pass purges every published row); where a literal zero makes no sense
// (--handover-after: at the first unanswered publish; --stream-duplicates: JetStream's
// default window) 0 is refused, never read as off or as the default.
func TestOffForeverFlagsTakeMinusOneAndTheWord(t *testing.T) {
	t.Parallel()
	// The table is complete: every field taking -1 has its flag in it.
	rc := (&relay.Config{}).WithDefaults()
	cc := (&checkback.Config{}).WithDefaults()
	want := takesMinusOne(t, rc, func() error { return relay.ValidateConfig(rc) }, fieldFlags)
	want = append(want, takesMinusOne(t, cc, func() error { return checkback.ValidateConfig(cc) }, checkbackFieldFlags)...)
	for _, name := range want {
		if _, ok := offForeverFlags["run"][name]; !ok {
			if _, ok := offForeverFlags["checkback"][name]; !ok {
				t.Errorf("--%s sets a field that takes -1, and is not in offForeverFlags", name)
			}
		}
	}
	if len(want) == 0 {
		t.Fatal("no field takes -1: the discovery is broken")
	}

	for command, flags := range offForeverFlags {
		for name, word := range flags {
			for _, v := range []string{"-1", word} {
				got, err := parseFlag(t, command, name, v)
				if err != nil || got != -1 {
					t.Errorf("relay %s --%s %s: %v, %v; want the field at -1", command, name, v, got, err)
				}
			}
			other := map[string]string{"off": "forever", "forever": "off"}[word]
			if _, err := parseFlag(t, command, name, other); err == nil {
				t.Errorf("relay %s --%s %s: accepted; only %s and -1 are its words", command, name, other, word)
			}
			if _, err := parseFlag(t, command, name, "-2"); err == nil {
				t.Errorf("relay %s --%s -2: accepted", command, name)
			}
		}
	}
	// The older spellings keep their meaning.
	for _, c := range []struct {
		command, flag, value string
		want                 float64
	}{
		{"run", "backoff-jitter", "0", txoutbox.Off},
		{"run", "check-backoff-jitter", "0", txoutbox.Off},
		{"run", "check-transaction-timeout", "0", txoutbox.Off},
		{"checkback", "check-transaction-timeout", "0", txoutbox.Off},
		{"run", "retention", "0", 0}, // delete at once
		// As the relay's 0: keep no published row (a split deployment sharing
		// TXOUTBOX_RETENTION=0 purges what the relay deletes anyway: nothing).
		{"checkback", "retention", "0", float64(time.Nanosecond)},
		{"run", "retention", "1h", float64(time.Hour)},
		{"run", "backoff-jitter", "0.5", 0.5},
		{"checkback", "check-group-rate", "2.5", 2.5},
	} {
		if got, err := parseFlag(t, c.command, c.flag, c.value); err != nil || got != c.want {
			t.Errorf("relay %s --%s %s: %v, %v; want %v", c.command, c.flag, c.value, got, err, c.want)
		}
	}
}

// A 0 that has no literal meaning is refused, naming the flag, never read as off or as the
// default; a plain duration flag (no off or forever) says so for -1 and negative values.
func TestZeroWithoutMeaningIsRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--handover-after", "0"}, "invalid --handover-after 0: the partitions would be handed over at the first publish"},
		{[]string{"--stream-duplicates", "0"}, "invalid --stream-duplicates: must be positive"},
		{[]string{"--publish-timeout", "-1"}, `invalid value "-1" for flag -publish-timeout: must not be negative (this setting has no off or forever)`},
		{[]string{"--lease-interval", "-2s"}, `invalid value "-2s" for flag -lease-interval: must not be negative`},
		{[]string{"--poll-max", "5"}, `invalid value "5" for flag -poll-max: not a duration (a number with a unit: 500ms, 30s, 1h30m)`},
		{[]string{"--check-request-timeout", "-1"}, `invalid value "-1" for flag -check-request-timeout: must not be negative`},
	} {
		code, _, stderr := cli(t, append([]string{"run", "--database-url", "postgres://127.0.0.1:1/none"}, c.args...)...)
		if code != 2 || !strings.Contains(stderr, c.want) {
			t.Errorf("relay run %v: exit %d, %q; want exit 2 saying %q", c.args, code, stderr, c.want)
		}
	}
	// Through the environment too.
	var errb strings.Builder
	code := Main(context.Background(), []string{"run", "--database-url", "postgres://127.0.0.1:1/none"},
		&Env{Stdout: io.Discard, Stderr: &errb, Getenv: func(k string) string {
			return map[string]string{"TXOUTBOX_HANDOVER_AFTER": "0"}[k]
		}})
	if code != 2 || !strings.Contains(errb.String(), "invalid --handover-after 0") {
		t.Errorf("TXOUTBOX_HANDOVER_AFTER=0: exit %d, %q; want exit 2 naming --handover-after", code, errb.String())
	}
}
