package txoutbox_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/checkback"
	"github.com/txoutbox/txoutbox/consumer"
	"github.com/txoutbox/txoutbox/migrations"
	"github.com/txoutbox/txoutbox/outbox"
	"github.com/txoutbox/txoutbox/outbox/checker"
	"github.com/txoutbox/txoutbox/relay"
)

// Every package reports configuration errors the same way: a *txoutbox.ConfigError naming
// the package and the field, matching ErrInvalidConfig.
func TestEveryPackageReportsOneConfigError(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("s", 64)
	_, outboxErr := outbox.NewClient(&outbox.Config{Schema: long})
	_, migErr := migrations.New(&migrations.Config{Schema: long})
	for _, tc := range []struct {
		pkg, field string
		err        error
	}{
		{"relay", "Config.Schema", relay.ValidateConfig(&relay.Config{Schema: long})},
		{"consumer", "Config.Schema", consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", Schema: long})},
		{"checkback", "Config.Schema", checkback.ValidateConfig(&checkback.Config{Schema: long})},
		{"outbox", "Config.Schema", outboxErr},
		{"outbox", "Config.Schema", outbox.ValidateConfig(&outbox.Config{Schema: long})},
		{"migrations", "Config.Schema", migErr},
		{"migrations", "Config.Schema", migrations.ValidateConfig(&migrations.Config{Schema: long})},
		{"outbox", "Config.MaxMessageBytes", func() error { _, err := outbox.NewClient(&outbox.Config{MaxMessageBytes: 10}); return err }()},
		{"checker", "Config.SubjectPrefix", checker.ValidateConfig(&checker.Config{Outbox: "o", SubjectPrefix: "a..b"})},
		{"checker", "Config.Outbox", checker.ValidateConfig(nil)},
	} {
		var ce *txoutbox.ConfigError
		if !errors.As(tc.err, &ce) || ce.Package != tc.pkg || ce.Field != tc.field {
			t.Errorf("%s %s: got %v (%T), want a *txoutbox.ConfigError naming it", tc.pkg, tc.field, tc.err, tc.err)
			continue
		}
		if !errors.Is(tc.err, txoutbox.ErrInvalidConfig) {
			t.Errorf("%s: %v does not match ErrInvalidConfig", tc.pkg, tc.err)
		}
		if !strings.HasPrefix(tc.err.Error(), tc.pkg+": "+tc.field+" ") {
			t.Errorf("%s: message %q does not start with the package and the field", tc.pkg, tc.err)
		}
	}
}

// One rule for "off" and "forever": -1 is kept by WithDefaults and accepted where documented;
// any other negative value is refused, naming the field; zero is the default.
func TestOffAndForeverAreMinusOneEverywhere(t *testing.T) {
	t.Parallel()
	type check struct {
		name     string
		validate func(v float64) error // sets the field to v and validates
		get      func(v float64) float64
	}
	relayField := func(set func(*relay.Config, float64), get func(*relay.Config) float64) (func(float64) error, func(float64) float64) {
		return func(v float64) error { c := &relay.Config{}; set(c, v); return relay.ValidateConfig(c) },
			func(v float64) float64 { c := &relay.Config{}; set(c, v); return get(c.WithDefaults()) }
	}
	cbField := func(set func(*checkback.Config, float64), get func(*checkback.Config) float64) (func(float64) error, func(float64) float64) {
		return func(v float64) error { c := &checkback.Config{}; set(c, v); return checkback.ValidateConfig(c) },
			func(v float64) float64 { c := &checkback.Config{}; set(c, v); return get(c.WithDefaults()) }
	}
	conField := func(set func(*consumer.Config, float64), get func(*consumer.Config) float64) (func(float64) error, func(float64) float64) {
		return func(v float64) error {
				c := &consumer.Config{Stream: "S", Durable: "d"}
				set(c, v)
				return consumer.ValidateConfig(c)
			},
			func(v float64) float64 {
				c := &consumer.Config{Stream: "S", Durable: "d"}
				set(c, v)
				return get(c.WithDefaults())
			}
	}
	dur := func(v float64) time.Duration {
		if v == -1 {
			return -1
		}
		return time.Duration(v * float64(time.Second))
	}
	var checks []check
	add := func(name string, v func(float64) error, g func(float64) float64) {
		checks = append(checks, check{name, v, g})
	}
	v, g := relayField(func(c *relay.Config, x float64) { c.BackoffJitter = x }, func(c *relay.Config) float64 { return c.BackoffJitter })
	add("relay BackoffJitter", v, g)
	v, g = relayField(func(c *relay.Config, x float64) { c.Retention = dur(x) }, func(c *relay.Config) float64 { return float64(c.Retention) })
	add("relay Retention", v, g)
	v, g = relayField(func(c *relay.Config, x float64) { c.HandoverAfter = dur(x) }, func(c *relay.Config) float64 { return float64(c.HandoverAfter) })
	add("relay HandoverAfter", v, g)
	v, g = cbField(func(c *checkback.Config, x float64) { c.BackoffJitter = x }, func(c *checkback.Config) float64 { return c.BackoffJitter })
	add("checkback BackoffJitter", v, g)
	v, g = cbField(func(c *checkback.Config, x float64) { c.TransactionTimeout = dur(x) }, func(c *checkback.Config) float64 { return float64(c.TransactionTimeout) })
	add("checkback TransactionTimeout", v, g)
	v, g = cbField(func(c *checkback.Config, x float64) { c.PublishedRetention = dur(x) }, func(c *checkback.Config) float64 { return float64(c.PublishedRetention) })
	add("checkback PublishedRetention", v, g)
	v, g = cbField(func(c *checkback.Config, x float64) { c.RolledBackRetention = dur(x) }, func(c *checkback.Config) float64 { return float64(c.RolledBackRetention) })
	add("checkback RolledBackRetention", v, g)
	v, g = cbField(func(c *checkback.Config, x float64) { c.DedupRetention = dur(x) }, func(c *checkback.Config) float64 { return float64(c.DedupRetention) })
	add("checkback DedupRetention", v, g)
	v, g = conField(func(c *consumer.Config, x float64) { c.BackoffJitter = x }, func(c *consumer.Config) float64 { return c.BackoffJitter })
	add("consumer BackoffJitter", v, g)
	v, g = conField(func(c *consumer.Config, x float64) { c.StopTimeout = dur(x) }, func(c *consumer.Config) float64 { return float64(c.StopTimeout) })
	add("consumer StopTimeout", v, g)

	for _, c := range checks {
		if err := c.validate(txoutbox.Off); err != nil {
			t.Errorf("%s = -1 refused: %v", c.name, err)
		}
		if got := c.get(txoutbox.Off); got != -1 {
			t.Errorf("%s = -1 became %v after WithDefaults", c.name, got)
		}
		if got := c.get(0); got == 0 && c.name != "relay Retention" {
			t.Errorf("%s = 0 did not take a default", c.name)
		}
		err := c.validate(-2)
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || !strings.HasSuffix(c.name, strings.TrimPrefix(ce.Field, "Config.")) {
			t.Errorf("%s = -2 (or -2s): got %v, want a ConfigError naming it", c.name, err)
		}
	}
	// Jitter is one range everywhere: [0, 1).
	for _, err := range []error{
		relay.ValidateConfig(&relay.Config{BackoffJitter: 1}),
		checkback.ValidateConfig(&checkback.Config{BackoffJitter: 1}),
		consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d", BackoffJitter: 1}),
	} {
		if !errors.Is(err, txoutbox.ErrInvalidConfig) {
			t.Errorf("a jitter of 1 was accepted: %v", err)
		}
	}
	// The checker's Options have no off or forever value: every negative is refused, naming
	// the field, and zero is the default.
	for _, c := range []struct {
		field string
		set   func(*checker.Config, int)
		get   func(*checker.Config) int
	}{
		{"Concurrency", func(o *checker.Config, v int) { o.Concurrency = v }, func(o *checker.Config) int { return o.Concurrency }},
		{"Timeout", func(o *checker.Config, v int) { o.Timeout = time.Duration(v) }, func(o *checker.Config) int { return int(o.Timeout) }},
	} {
		for _, v := range []int{-1, -2} {
			o := &checker.Config{Outbox: "o"}
			c.set(o, v)
			var ce *txoutbox.ConfigError
			if err := checker.ValidateConfig(o); !errors.As(err, &ce) || ce.Field != "Config."+c.field {
				t.Errorf("checker %s = %d: got %v, want a ConfigError naming it", c.field, v, err)
			}
		}
		if got := c.get((&checker.Config{}).WithDefaults()); got <= 0 {
			t.Errorf("checker %s = 0 did not take a default (got %d)", c.field, got)
		}
	}
	if (&relay.Config{}).WithDefaults().Retention != 0 {
		t.Error("relay Retention defaults to something other than none")
	}
	if (&checkback.Config{}).WithDefaults().PublishedRetention != txoutbox.Forever {
		t.Error("checkback PublishedRetention does not default to Forever")
	}
}

// Every component exposes its effective Config the same way: WithDefaults, ValidateConfig and
// a Config accessor on what New returns.
func TestEveryComponentReturnsItsEffectiveConfig(t *testing.T) {
	t.Parallel()
	c, err := outbox.NewClient(&outbox.Config{Schema: "s1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Config(); got.Schema != "s1" || got.MaxMessageBytes != outbox.DefaultMaxMessageBytes {
		t.Errorf("outbox Client.Config() = %+v", got)
	}
	m, err := migrations.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Config(); got.Schema != txoutbox.DefaultSchema {
		t.Errorf("migrations Migrator.Config().Schema = %q, want %q", got.Schema, txoutbox.DefaultSchema)
	}
	for name, err := range map[string]error{
		"outbox":     outbox.ValidateConfig(nil),
		"migrations": migrations.ValidateConfig(nil),
		"relay":      relay.ValidateConfig(nil),
		"checkback":  checkback.ValidateConfig(nil),
		"checker":    checker.ValidateConfig(&checker.Config{Outbox: "o"}),
		"consumer":   consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: "d"}),
	} {
		if err != nil {
			t.Errorf("%s: the defaults are invalid: %v", name, err)
		}
	}
}

// One stream and consumer name rule: relay.Config.CreateStream and consumer.Config.Stream and
// Durable accept and refuse the same names, JetStream's (at most 255 bytes, no '.', '*', '>',
// white space or path separators), each refusal naming its field.
func TestOneStreamNameRule(t *testing.T) {
	t.Parallel()
	type check struct {
		field    string
		validate func(name string) error
	}
	checks := []check{
		{"Config.CreateStream", func(n string) error { return relay.ValidateConfig(&relay.Config{CreateStream: n}) }},
		{"Config.Stream", func(n string) error {
			return consumer.ValidateConfig(&consumer.Config{Stream: n, Durable: "d"})
		}},
		{"Config.Durable", func(n string) error {
			return consumer.ValidateConfig(&consumer.Config{Stream: "S", Durable: n})
		}},
	}
	for _, c := range checks {
		for _, ok := range []string{"ORDERS", "orders-v2_eu", strings.Repeat("s", 255)} {
			if err := c.validate(ok); err != nil {
				t.Errorf("%s %q refused: %v", c.field, ok, err)
			}
		}
		for _, bad := range []string{strings.Repeat("s", 256), "a.b", "a*", "a>", "a b", "a/b", `a\b`} {
			var ce *txoutbox.ConfigError
			if err := c.validate(bad); !errors.As(err, &ce) || ce.Field != c.field {
				t.Errorf("%s %.20q: got %v, want a ConfigError naming it", c.field, bad, err)
			}
		}
	}
}

// Where two packages share a default, one is defined as the other: they cannot drift.
func TestSharedDefaultsAgree(t *testing.T) {
	t.Parallel()
	if checkback.DefaultRequestTimeout != checker.DefaultTimeout {
		t.Errorf("checkback.DefaultRequestTimeout %s, checker.DefaultTimeout %s", checkback.DefaultRequestTimeout, checker.DefaultTimeout)
	}
	if checkback.DefaultSubjectPrefix != checker.DefaultSubjectPrefix {
		t.Errorf("checkback.DefaultSubjectPrefix %q, checker.DefaultSubjectPrefix %q", checkback.DefaultSubjectPrefix, checker.DefaultSubjectPrefix)
	}
	if relay.DefaultDoorbellSubject != outbox.DefaultDoorbellSubject {
		t.Errorf("relay.DefaultDoorbellSubject %q, outbox.DefaultDoorbellSubject %q", relay.DefaultDoorbellSubject, outbox.DefaultDoorbellSubject)
	}
	if migrations.DownAll != txoutbox.Forever {
		t.Errorf("migrations.DownAll %d, want txoutbox.Forever", migrations.DownAll)
	}
}
