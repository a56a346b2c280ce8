package consumer

import (
	"errors"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox"
)

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	ok := func() *Config { return &Config{Stream: "ORDERS", Durable: "billing"} }
	if err := ValidateConfig(ok()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	d := ok().WithDefaults()
	if d.DeadLetterSubject != "txoutbox.dead.billing" || d.InProgressInterval != 10*time.Second ||
		d.StopTimeout != DefaultAckWait || d.PullMaxMessages != 16 || d.BatchSize != 1 {
		t.Fatalf("defaults: %+v", d)
	}
	half := ok()
	half.AckWait, half.InProgressInterval = time.Second, 500*time.Millisecond
	if err := ValidateConfig(half); err != nil {
		t.Fatalf("InProgressInterval = AckWait/2: %v", err)
	}
	cases := []struct {
		field  string
		mutate func(*Config)
	}{
		{"Stream", func(c *Config) { c.Stream = "" }},
		{"Stream", func(c *Config) { c.Stream = "a.b" }},
		{"Durable", func(c *Config) { c.Durable = "" }},
		{"Durable", func(c *Config) { c.Durable = "has space" }},
		{"Schema", func(c *Config) { c.Schema = "nul\x00byte" }},
		{"FilterSubjects", func(c *Config) { c.FilterSubjects = []string{"orders..x"} }},
		{"DeadLetterSubject", func(c *Config) { c.DeadLetterSubject = "dead.*" }},
		{"DeadLetterSubject", func(c *Config) {
			c.FilterSubjects = []string{"orders.>"}
			c.DeadLetterSubject = "orders.dead"
		}},
		{"Concurrency", func(c *Config) { c.Concurrency = -1 }},
		{"BatchSize", func(c *Config) { c.BatchSize = MaxBatchSize + 1 }},
		{"BatchWait", func(c *Config) { c.BatchWait = -time.Second }},
		{"MaxDeliveries", func(c *Config) { c.MaxDeliveries = -2 }},
		{"BackoffBase", func(c *Config) { c.BackoffBase = -time.Second }},
		{"BackoffMax", func(c *Config) { c.BackoffBase, c.BackoffMax = time.Minute, time.Second }},
		{"BackoffJitter", func(c *Config) { c.BackoffJitter = 1.5 }},
		{"InProgressInterval", func(c *Config) { c.AckWait, c.InProgressInterval = time.Second, 2*time.Second }},
		{"InProgressInterval", func(c *Config) { c.AckWait, c.InProgressInterval = time.Second, 501*time.Millisecond }},
		{"InProgressInterval", func(c *Config) { c.InProgressInterval = -time.Second }},
		{"MaxAckPending", func(c *Config) { c.MaxAckPending = -1 }},
		{"StopTimeout", func(c *Config) { c.StopTimeout = -time.Second }},
	}
	for _, tc := range cases {
		c := ok()
		tc.mutate(c)
		err := ValidateConfig(c)
		var ce *txoutbox.ConfigError
		if !errors.As(err, &ce) || ce.Field != "Config."+tc.field {
			t.Errorf("%s: got %v, want a *ConfigError naming the field", tc.field, err)
		}
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	c := (&Config{Stream: "S", Durable: "d", BackoffBase: time.Second, BackoffMax: 10 * time.Second}).WithDefaults()
	for attempt, want := range map[int]time.Duration{0: time.Second, 1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 4: 8 * time.Second, 5: 10 * time.Second, 30: 10 * time.Second} {
		lo, hi := time.Duration(float64(want)*(1-DefaultBackoffJitter)), min(time.Duration(float64(want)*(1+DefaultBackoffJitter)), c.BackoffMax)
		for range 100 {
			if d := c.backoff(attempt); d < lo || d > hi {
				t.Fatalf("attempt %d: random delay %s outside [%s, %s]", attempt, d, lo, hi)
			}
		}
	}
	c.BackoffJitter = txoutbox.Off
	if d := c.backoff(3); d != 4*time.Second {
		t.Fatalf("no jitter: %s, want 4s", d)
	}
}
