package txoutbox_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"

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

// fieldRule is what the convention says of one numeric Config field.
type fieldRule struct {
	// def is the value WithDefaults gives the zero field: a Default… constant, or derived
	// for a default computed from other fields (documented as such).
	def any
	// minus1 says the field takes txoutbox.Off or txoutbox.Forever (-1), and its doc says so;
	// every other numeric field refuses -1.
	minus1 bool
}

// derived marks a default computed from other fields, which no constant can hold.
var derived = new(struct{})

type component struct {
	name     string
	fresh    func() any // a new, valid *Config
	validate func(cfg any) error
	defaults func(cfg any) any // cfg.WithDefaults()
	rules    map[string]fieldRule
}

func components() []component {
	newConsumer := func() *consumer.Config { return &consumer.Config{Stream: "S", Durable: "d"} }
	return []component{
		{"relay", func() any { return &relay.Config{} },
			func(c any) error { return relay.ValidateConfig(c.(*relay.Config)) },
			func(c any) any { return c.(*relay.Config).WithDefaults() },
			map[string]fieldRule{
				"BatchSize": {def: relay.DefaultBatchSize}, "MaxInFlight": {def: relay.DefaultMaxInFlight},
				"PublishTimeout": {def: relay.DefaultPublishTimeout}, "PollMin": {def: relay.DefaultPollMin},
				"PollMax": {def: relay.DefaultPollMax}, "BackoffBase": {def: relay.DefaultBackoffBase},
				"BackoffMax": {def: relay.DefaultBackoffMax}, "BackoffJitter": {def: relay.DefaultBackoffJitter, minus1: true},
				"MaxAttempts": {def: relay.DefaultMaxAttempts}, "Retention": {def: relay.DefaultRetention, minus1: true},
				"Partitions": {def: relay.DefaultPartitions}, "LeaseInterval": {def: relay.DefaultLeaseInterval},
				"HandoverAfter": {def: relay.DefaultHandoverAfter, minus1: true}, "StreamDuplicates": {def: relay.DefaultStreamDuplicates},
				"SampleInterval": {def: relay.DefaultSampleInterval}, "SampleLimit": {def: relay.DefaultSampleLimit},
				"MaxMessageBytes": {def: relay.DefaultMaxMessageBytes, minus1: true},
			}},
		{"consumer", func() any { return newConsumer() },
			func(c any) error { return consumer.ValidateConfig(c.(*consumer.Config)) },
			func(c any) any { return c.(*consumer.Config).WithDefaults() },
			map[string]fieldRule{
				"Concurrency": {def: consumer.DefaultConcurrency}, "BatchSize": {def: consumer.DefaultBatchSize},
				"BatchWait": {def: consumer.DefaultBatchWait}, "MaxDeliveries": {def: consumer.DefaultMaxDeliveries},
				"BackoffBase": {def: consumer.DefaultBackoffBase}, "BackoffMax": {def: consumer.DefaultBackoffMax},
				"BackoffJitter": {def: consumer.DefaultBackoffJitter, minus1: true}, "AckWait": {def: consumer.DefaultAckWait},
				"InProgressInterval": {def: derived}, "MaxAckPending": {def: consumer.DefaultMaxAckPending},
				"PullMaxMessages": {def: derived}, "PullHeartbeat": {def: consumer.DefaultPullHeartbeat},
				"StopTimeout": {def: derived, minus1: true},
			}},
		{"checkback", func() any { return &checkback.Config{} },
			func(c any) error { return checkback.ValidateConfig(c.(*checkback.Config)) },
			func(c any) any { return c.(*checkback.Config).WithDefaults() },
			map[string]fieldRule{
				"TransactionTimeout": {def: checkback.DefaultTransactionTimeout, minus1: true}, "MaxChecks": {def: checkback.DefaultMaxChecks},
				"RequestTimeout": {def: checkback.DefaultRequestTimeout}, "BackoffBase": {def: checkback.DefaultBackoffBase},
				"BackoffMax": {def: checkback.DefaultBackoffMax}, "BackoffJitter": {def: checkback.DefaultBackoffJitter, minus1: true},
				"BatchSize": {def: checkback.DefaultBatchSize}, "GroupConcurrency": {def: checkback.DefaultGroupConcurrency},
				"GroupRate": {def: checkback.DefaultGroupRate, minus1: true}, "StaleReadyAfter": {def: checkback.DefaultStaleReadyAfter},
				"PublishedRetention":  {def: checkback.DefaultPublishedRetention, minus1: true},
				"RolledBackRetention": {def: checkback.DefaultRolledBackRetention, minus1: true},
				"DedupRetention":      {def: checkback.DefaultDedupRetention, minus1: true}, "PurgeBatchSize": {def: checkback.DefaultPurgeBatchSize},
			}},
		{"checker", func() any { return &checker.Config{Outbox: "o"} },
			func(c any) error { return checker.ValidateConfig(c.(*checker.Config)) },
			func(c any) any { return c.(*checker.Config).WithDefaults() },
			map[string]fieldRule{"Concurrency": {def: checker.DefaultConcurrency}, "Timeout": {def: checker.DefaultTimeout}}},
		{"outbox", func() any { return &outbox.Config{} },
			func(c any) error { return outbox.ValidateConfig(c.(*outbox.Config)) },
			func(c any) any { return c.(*outbox.Config).WithDefaults() },
			map[string]fieldRule{"MaxMessageBytes": {def: outbox.DefaultMaxMessageBytes}}},
		{"migrations", func() any { return &migrations.Config{} },
			func(c any) error { return migrations.ValidateConfig(c.(*migrations.Config)) },
			func(c any) any { return c.(*migrations.Config).WithDefaults() },
			map[string]fieldRule{}},
	}
}

// One rule for every numeric field of every Config (counts, sizes, rates, durations,
// factors), enforced field by field so that a new field cannot escape it:
//   - zero takes the default, an exported Default… constant unless derived from other fields;
//   - -1 (txoutbox.Off / txoutbox.Forever) is accepted and kept by WithDefaults exactly where
//     the field says so, and refused, naming the field, everywhere else;
//   - -2 is refused everywhere, naming the field.
func TestEveryNumericFieldFollowsTheConvention(t *testing.T) {
	t.Parallel()
	for _, c := range components() {
		typ := reflect.TypeOf(c.fresh()).Elem()
		seen := map[string]bool{}
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			switch f.Type.Kind() {
			case reflect.Int, reflect.Int64, reflect.Float64:
			default:
				continue
			}
			name := c.name + " Config." + f.Name
			seen[f.Name] = true
			rule, ok := c.rules[f.Name]
			if !ok {
				t.Errorf("%s is not listed here: state its default and whether it takes -1", name)
				continue
			}
			with := func(v float64) any {
				cfg := c.fresh()
				fv := reflect.ValueOf(cfg).Elem().Field(i)
				if fv.Kind() == reflect.Float64 {
					fv.SetFloat(v)
				} else {
					fv.SetInt(int64(v))
				}
				return cfg
			}
			field := func(cfg any) reflect.Value { return reflect.ValueOf(cfg).Elem().Field(i) }

			if rule.def != derived {
				got := field(c.defaults(with(0)))
				want := reflect.ValueOf(rule.def).Convert(f.Type)
				if !got.Equal(want) {
					t.Errorf("%s = 0 became %v after WithDefaults, want the Default constant %v", name, got, want)
				}
			} else if got := field(c.defaults(with(0))); got.IsZero() {
				t.Errorf("%s = 0 did not take its derived default", name)
			}

			err := c.validate(with(-1))
			var ce *txoutbox.ConfigError
			switch {
			case rule.minus1 && err != nil:
				t.Errorf("%s = -1 refused: %v", name, err)
			case rule.minus1:
				if got := field(c.defaults(with(-1))); !got.Equal(reflect.ValueOf(-1).Convert(f.Type)) {
					t.Errorf("%s = -1 became %v after WithDefaults", name, got)
				}
			case !errors.As(err, &ce) || ce.Field != "Config."+f.Name || ce.Package != c.name:
				t.Errorf("%s = -1: got %v, want a ConfigError naming it (it has no off or forever value)", name, err)
			}
			if err := c.validate(with(-2)); !errors.As(err, &ce) || ce.Field != "Config."+f.Name {
				t.Errorf("%s = -2: got %v, want a ConfigError naming it", name, err)
			}
		}
		for f := range c.rules {
			if !seen[f] {
				t.Errorf("%s Config.%s is listed here but is not a numeric field", c.name, f)
			}
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
