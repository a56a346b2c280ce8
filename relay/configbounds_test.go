package relay

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/outbox"
)

// A field set alone, above the default of the field that must be at least it, is valid: the
// other takes the larger of its default and it (setting PollMin: 2s alone failed on PollMax,
// BackoffBase: 2m alone on BackoffMax). A value set for both is still checked.
func TestRelatedDefaultsFollowTheFieldSet(t *testing.T) {
	t.Parallel()
	c := (&Config{PollMin: 2 * time.Second}).WithDefaults()
	if err := c.validate(); err != nil || c.PollMax != 2*time.Second {
		t.Fatalf("PollMin 2s alone: PollMax = %s, validate = %v; want 2s and valid", c.PollMax, err)
	}
	c = (&Config{BackoffBase: 2 * time.Minute}).WithDefaults()
	if err := c.validate(); err != nil || c.BackoffMax != 2*time.Minute {
		t.Fatalf("BackoffBase 2m alone: BackoffMax = %s, validate = %v; want 2m and valid", c.BackoffMax, err)
	}
	if c := (&Config{}).WithDefaults(); c.PollMax != DefaultPollMax || c.BackoffMax != DefaultBackoffMax {
		t.Fatalf("defaults: PollMax %s, BackoffMax %s", c.PollMax, c.BackoffMax)
	}
	for field, cfg := range map[string]*Config{
		"PollMax":    {PollMin: 2 * time.Second, PollMax: time.Second},
		"BackoffMax": {BackoffBase: 2 * time.Minute, BackoffMax: time.Minute},
	} {
		assertFieldError(t, field, ValidateConfig(cfg))
	}
}

func assertFieldError(t *testing.T, field string, err error) {
	t.Helper()
	var ce *txoutbox.ConfigError
	if !errors.As(err, &ce) || ce.Package != "relay" || ce.Field != "Config."+field {
		t.Errorf("%s: got %v, want a ConfigError naming Config.%s", field, err, field)
	}
}

// BackoffBase and BackoffMax are at most 24h; a jitter of 0 is the default, so the range
// left to set is (0, 1).
func TestBackoffBounds(t *testing.T) {
	t.Parallel()
	const day = 24 * time.Hour
	for _, cfg := range []*Config{{BackoffMax: day}, {BackoffBase: day}, {BackoffBase: day, BackoffMax: day}} {
		if err := ValidateConfig(cfg); err != nil {
			t.Errorf("%+v: %v, want 24h accepted", cfg, err)
		}
	}
	assertFieldError(t, "BackoffMax", ValidateConfig(&Config{BackoffMax: day + time.Nanosecond}))
	assertFieldError(t, "BackoffMax", ValidateConfig(&Config{BackoffMax: math.MaxInt64}))
	assertFieldError(t, "BackoffBase", ValidateConfig(&Config{BackoffBase: day + time.Nanosecond}))
	if c := (&Config{BackoffJitter: 0}).WithDefaults(); c.BackoffJitter != DefaultBackoffJitter {
		t.Errorf("BackoffJitter 0 became %g, want the default", c.BackoffJitter)
	}
	for _, j := range []float64{txoutbox.Off, 0.0001, 0.9999} {
		if err := ValidateConfig(&Config{BackoffJitter: j}); err != nil {
			t.Errorf("BackoffJitter %g: %v", j, err)
		}
	}
}

// The duplicate window the relays need saturates instead of overflowing to a negative
// window every stream would satisfy; so do the drain bound and the poll's doubling.
func TestRequiredDuplicateWindowSaturates(t *testing.T) {
	t.Parallel()
	for _, cfg := range []*Config{
		{LeaseInterval: math.MaxInt64 / 4},
		{LeaseInterval: math.MaxInt64},
		{PublishTimeout: math.MaxInt64, BackoffMax: time.Hour},
		{HandoverAfter: math.MaxInt64 - time.Second, LeaseInterval: time.Hour},
	} {
		if got := cfg.RequiredDuplicateWindow(); got != math.MaxInt64 {
			t.Errorf("%+v: RequiredDuplicateWindow = %s, want the largest duration", cfg, got)
		}
	}
	if got := (&Config{PublishTimeout: math.MaxInt64}).MaxStopTime(); got != math.MaxInt64 {
		t.Errorf("MaxStopTime = %s, want the largest duration", got)
	}
	if got := (&Config{}).RequiredDuplicateWindow(); got != 68*time.Second {
		t.Errorf("RequiredDuplicateWindow with the defaults = %s, want 68s (5s + 2s + 1s + 1m)", got)
	}
	if got := mulSat(2, math.MaxInt64/2+1); got != math.MaxInt64 {
		t.Errorf("mulSat = %s", got)
	}
}

// ID and DoorbellChannel are PostgreSQL text: an ID with a NUL byte made every lease round
// fail (reported as a PostgreSQL outage, for ever), and a channel longer than 63 bytes was
// cut short by LISTEN while the producers' pg_notify on the full name failed.
func TestIDAndDoorbellChannelAreValidated(t *testing.T) {
	t.Parallel()
	for field, cfg := range map[string][]*Config{
		"ID": {{ID: "relay\x00a"}, {ID: "relay\xff"}},
		"DoorbellChannel": {
			{DoorbellChannel: strings.Repeat("c", 64)},
			{DoorbellChannel: "bell\x00"},
			{DoorbellChannel: "bell\xc3"},
			{DoorbellChannel: strings.Repeat("é", 32)}, // 64 bytes
		},
	} {
		for _, cfg := range cfg {
			assertFieldError(t, field, ValidateConfig(cfg))
		}
	}
	for _, cfg := range []*Config{
		{DoorbellChannel: strings.Repeat("c", 63)},
		{DoorbellChannel: "txoutbox_doorbell"},
		{DoorbellChannel: "sonnette_é"},
		{ID: "relay-1 (eu-west) ✓"},
	} {
		if err := ValidateConfig(cfg); err != nil {
			t.Errorf("%+v: %v", cfg, err)
		}
	}
	// One rule with the producers': every channel the relay refuses, they refuse, and back.
	for _, ch := range []string{"", "bell", strings.Repeat("c", 63), strings.Repeat("c", 64), "bell\x00", "bell\xc3", strings.Repeat("é", 32)} {
		relayErr := ValidateConfig(&Config{DoorbellChannel: ch})
		producerErr := outbox.ValidateDoorbellChannel(ch)
		if ch != "" && (relayErr == nil) != (producerErr == nil) {
			t.Errorf("channel %q: relay %v, producers %v; want one rule", ch, relayErr, producerErr)
		}
	}
	// The default ID, hostname:pid, is itself valid.
	if c := (&Config{}).WithDefaults(); c.ID == "" || !utf8.ValidString(c.ID) || strings.ContainsRune(c.ID, 0) || strings.HasPrefix(c.ID, ":") {
		t.Errorf("default ID %q", c.ID)
	}
}

// LeaseInterval is bounded above too: its multiples (the lease, the fence, the duplicate
// window the relays need) stay far from overflowing.
func TestLeaseIntervalIsBounded(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{maxLeaseInterval + time.Nanosecond, math.MaxInt64} {
		assertFieldError(t, "LeaseInterval", ValidateConfig(&Config{LeaseInterval: d}))
	}
	if err := ValidateConfig(&Config{LeaseInterval: maxLeaseInterval}); err != nil {
		t.Fatalf("LeaseInterval %s: %v", maxLeaseInterval, err)
	}
}
