package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/internal/natsname"
	"github.com/txoutbox/txoutbox/outbox"
)

// StreamError says which subject lacks a stream, which stream's duplicate window is short, or
// which stream cannot take the relay's publishes and why.
type StreamError struct {
	Subject  string
	Stream   string
	Err      error // ErrNoStream, ErrDuplicateWindow or ErrStreamUnusable
	Window   string
	Required string
	// Partial names the streams that capture only part of Subject (ErrNoStream).
	Partial []string
	// Setting is the stream setting that makes it unusable, as JetStream names it ("no_ack",
	// "sealed", "mirror", "allow_msg_counter"), and Reason what it does (ErrStreamUnusable).
	Setting string
	Reason  string
	// Limit is the stream's max_msg_size or the server's max_payload, and Producers the
	// producers' limit it is below (ErrMessageLimit).
	Limit, Producers int64
}

func (e *StreamError) Error() string {
	if errors.Is(e.Err, ErrMessageLimit) {
		where := fmt.Sprintf("stream %q (capturing %q) has max_msg_size %d", e.Stream, e.Subject, e.Limit)
		if e.Stream == "" {
			where = fmt.Sprintf("the nats-server's max_payload is %d", e.Limit)
		}
		return fmt.Sprintf("%v: %s bytes, but producers may enqueue messages of up to %d bytes (%s), which could never be published; "+
			"raise the stream's max_msg_size or the server's max_payload, or lower the producers' outbox.Config.MaxMessageBytes "+
			"(and txoutbox.max_message_bytes for SQL producers) together with the relay's MaxMessageBytes (--max-message-bytes)",
			e.Err, where, e.Producers, e.Setting)
	}
	if errors.Is(e.Err, ErrStreamUnusable) {
		return fmt.Sprintf("%v: stream %q (capturing %q) %s", e.Err, e.Stream, e.Subject, e.Reason)
	}
	if errors.Is(e.Err, ErrDuplicateWindow) {
		return fmt.Sprintf("%v: stream %q (capturing %q) keeps duplicates for %s, but the relay may republish up to %s later "+
			"(PublishTimeout + min(PublishTimeout, 2s) + PollMax + max(BackoffMax, HandoverAfter + 2×LeaseInterval, 11s + 2×LeaseInterval, 14×LeaseInterval)); "+
			"raise the stream's duplicate window, or lower PublishTimeout, PollMax, BackoffMax, HandoverAfter or LeaseInterval", e.Err, e.Stream, e.Subject, e.Window, e.Required)
	}
	if len(e.Partial) > 0 {
		return fmt.Sprintf("%v %q: stream(s) %s capture only part of it; give one stream a subject that covers it, or serve narrower subjects",
			e.Err, e.Subject, strings.Join(e.Partial, ", "))
	}
	return fmt.Sprintf("%v %q: create a stream for it, or let the relay create one (CreateStream / --create-stream NAME)", e.Err, e.Subject)
}

func (e *StreamError) Unwrap() error { return e.Err }

// unusable reports whether a stream with cfg cannot take the relay's publishes: the setting
// responsible, as JetStream names it, and what it does ("" when the stream is usable).
//
// Settings that are fine: sources (a stream with subjects and sources takes publishes too),
// deny_delete, deny_purge, retention policies, placement, replicas, compression, TTLs,
// schedules, atomic and batch publishes. Discard-new with limits (max_msgs, max_bytes,
// max_msgs_per_subject) is operational, not a configuration error: a full stream refuses
// publishes with an error the relay stores, and the rows retry with backoff until it has
// room (or become dead after MaxAttempts). max_msg_size below what producers may enqueue is
// refused by CheckStreams (ErrMessageLimit), and a subject_transform logged as a warning.
func unusable(cfg *jetstream.StreamConfig) (setting, reason string) {
	switch {
	case cfg.Mirror != nil:
		return "mirror", "is a mirror: it only copies another stream and refuses publishes; capture the subject with another stream"
	case cfg.Sealed:
		return "sealed", "is sealed: it refuses every new message, for good; capture the subject with another stream"
	case cfg.NoAck:
		return "no_ack", "has no_ack set: it stores messages without acknowledging them, so no publish can be confirmed " +
			"(each one times out, and its message may be stored anyway); turn no_ack off"
	case cfg.AllowMsgCounter:
		return "allow_msg_counter", "is a counter stream (allow_msg_counter): it accepts only Nats-Incr increments; capture the subject with another stream"
	}
	return "", ""
}

// CheckStreams refuses a nats-server older than MinServerVersion (a *txoutbox.ServerVersionError,
// txoutbox.ErrServerTooOld), then verifies that one stream captures the whole of each of Config.Subjects (a
// stream that captures only part of a wildcard subject is not enough: the rest would fail
// message by message), that every stream the subject's messages may land in can take
// publishes (ErrStreamUnusable: no_ack, sealed, a mirror, a counter stream) and keeps
// duplicates at least RequiredDuplicateWindow. It refuses a server whose max_payload, or such a
// stream whose max_msg_size, is below what producers may enqueue (ErrMessageLimit; see
// Config.MaxMessageBytes). It creates, or extends, the stream Config.CreateStream names when a
// subject has none. It logs a warning for a stream that rewrites subjects. Each refusal of a
// stream or subject is a *StreamError wrapping ErrNoStream, ErrStreamUnusable,
// ErrDuplicateWindow or ErrMessageLimit; other errors are JetStream's or ctx's (Run waits
// and checks again on those that waiting can fix).
func (r *Relay) CheckStreams(ctx context.Context) error {
	if err := r.checkServerVersion(); err != nil {
		return err
	}
	required := r.cfg.RequiredDuplicateWindow()
	producers, producersSetting, err := r.producersLimit(ctx)
	if err != nil {
		return err
	}
	if err := r.checkMessageLimit("", nil, producers, producersSetting); err != nil {
		return err
	}
	for _, subj := range r.cfg.Subjects {
		streams, covering, err := r.streamsFor(ctx, subj)
		if err != nil {
			return err
		}
		if covering == "" {
			if r.cfg.CreateStream == "" || len(streams) > 0 {
				return &StreamError{Subject: subj, Err: ErrNoStream, Partial: slices.Sorted(maps.Keys(streams))}
			}
			if err := r.createStream(ctx, subj); err != nil {
				return err
			}
			if streams, _, err = r.streamsFor(ctx, subj); err != nil {
				return err
			}
		}
		for _, name := range slices.Sorted(maps.Keys(streams)) {
			cfg := streams[name]
			if setting, reason := unusable(&cfg); setting != "" {
				return &StreamError{Subject: subj, Stream: name, Err: ErrStreamUnusable, Setting: setting, Reason: reason}
			}
			if w := cfg.Duplicates; w < required {
				return &StreamError{Subject: subj, Stream: name, Err: ErrDuplicateWindow, Window: w.String(), Required: required.String()}
			}
			r.windows.checked(name)
			r.m.windowShort.WithLabelValues(name).Set(0)
			if err := r.checkMessageLimit(subj, &cfg, producers, producersSetting); err != nil {
				return err
			}
			r.warnStream(subj, &cfg)
		}
	}
	return nil
}

// producersLimit is the largest message producers may enqueue: Config.MaxMessageBytes, or
// the SQL producers' limit in the relay's database when that is larger (setting names where
// the limit comes from). It is 0 when the check is off.
func (r *Relay) producersLimit(ctx context.Context) (limit int64, setting string, err error) {
	if r.cfg.MaxMessageBytes == txoutbox.Off {
		return 0, "", nil
	}
	limit, setting = int64(r.cfg.MaxMessageBytes), "the relay's MaxMessageBytes"
	// The setting as txoutbox_max_message_bytes() reads it (migration 9), read here without
	// calling the function, which the relay's role need not be granted.
	var v *string
	if err := r.pool.QueryRow(ctx, "SELECT current_setting('txoutbox.max_message_bytes', true)").Scan(&v); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && !strings.HasPrefix(pgErr.Code, "08") && !strings.HasPrefix(pgErr.Code, "57P") {
			return 0, "", fmt.Errorf("relay: reading the SQL producers' message limit: %w", err)
		}
		// No answer (refused, reset, timed out, the server starting or shutting down): wait.
		return 0, "", &postgresUnavailableError{err: err}
	}
	sqlLimit := int64(outbox.DefaultMaxMessageBytes)
	if v != nil && strings.TrimSpace(*v) != "" {
		n, err := strconv.Atoi(strings.TrimSpace(*v))
		if t := strings.TrimSpace(*v); err != nil || strings.Trim(t, "0123456789") != "" || len(t) > 9 || n < 1024 || n > outbox.MaxMessageBytesLimit {
			return 0, "", &txoutbox.ConfigError{Package: "relay", Field: "txoutbox.max_message_bytes",
				Reason: fmt.Sprintf("invalid setting %q in the database: want a whole number of bytes from 1024 to %d (outbox.MaxMessageBytesLimit), or unset for %d",
					*v, outbox.MaxMessageBytesLimit, outbox.DefaultMaxMessageBytes)}
		}
		sqlLimit = int64(n)
	}
	if sqlLimit > limit {
		limit, setting = sqlLimit, "the database's txoutbox.max_message_bytes"
	}
	return limit, setting, nil
}

// checkMessageLimit refuses a stream (cfg) or, with cfg nil, the nats-server, that takes
// smaller messages than the producers may enqueue (ErrMessageLimit); with the check off it
// logs a warning instead. A message larger than the stream's max_msg_size (JetStream refuses
// it, 10054) or the server's max_payload (nats.go refuses it before sending,
// nats.ErrMaxPayload) can never be published: its row would be dead at once and hold its key
// back.
func (r *Relay) checkMessageLimit(subj string, cfg *jetstream.StreamConfig, producers int64, producersSetting string) error {
	if producers == 0 {
		producers, producersSetting = int64(outbox.DefaultMaxMessageBytes), "the producers' default limit"
	}
	var limit int64
	stream, what := "", "the server's max_payload"
	if cfg == nil {
		if nc := r.js.Conn(); nc != nil {
			limit = nc.MaxPayload()
		}
	} else {
		limit, stream, what = int64(cfg.MaxMsgSize), cfg.Name, "the stream's max_msg_size"
	}
	if limit <= 0 || limit >= producers {
		return nil
	}
	if r.cfg.MaxMessageBytes != txoutbox.Off {
		return &StreamError{Subject: subj, Stream: stream, Err: ErrMessageLimit, Setting: producersSetting, Limit: limit, Producers: producers}
	}
	r.log.Warn("the server or a stream accepts smaller messages than producers may enqueue by default: a larger one can never be published, "+
		"its row becomes dead at once and holds its key back; set the producers' outbox.Config.MaxMessageBytes to at most the limit, or raise it",
		"stream", stream, "subject", subj, "limit_bytes", limit, "limit", what, "producer_default_max_bytes", outbox.DefaultMaxMessageBytes)
	return nil
}

// warnStream logs what makes a usable stream a risk for some messages.
func (r *Relay) warnStream(subj string, cfg *jetstream.StreamConfig) {
	if cfg.SubjectTransform != nil {
		r.log.Warn("stream rewrites the subjects it stores (subject_transform): consumers see other subjects than the producers gave",
			"stream", cfg.Name, "subject", subj, "transform_source", cfg.SubjectTransform.Source, "transform_destination", cfg.SubjectTransform.Destination)
	}
}

// streamsFor returns the configurations of the streams whose subjects overlap subj, and the
// name of the one whose subjects cover all of subj ("" if none does).
func (r *Relay) streamsFor(ctx context.Context, subj string) (map[string]jetstream.StreamConfig, string, error) {
	// STREAM.NAMES and STREAM.INFO, not STREAM.LIST: the permissions a relay is likely given.
	names := r.js.StreamNames(ctx, jetstream.WithStreamListSubject(subj))
	var list []string
	for n := range names.Name() {
		list = append(list, n)
	}
	if err := names.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
		return nil, "", fmt.Errorf("relay: look up the streams for %q: %w", subj, err)
	}
	streams := make(map[string]jetstream.StreamConfig, len(list))
	covering := ""
	for _, n := range list {
		s, err := r.js.Stream(ctx, n)
		if err != nil {
			return nil, "", fmt.Errorf("relay: stream %q: %w", n, err)
		}
		cfg := s.CachedInfo().Config
		r.known.learn(&cfg)
		streams[n] = cfg
		for _, f := range cfg.Subjects {
			if natsname.Covers(f, subj) {
				covering = n
			}
		}
	}
	return streams, covering, nil
}

func (r *Relay) createStream(ctx context.Context, subj string) error {
	dup := max(r.cfg.StreamDuplicates, r.cfg.RequiredDuplicateWindow())
	s, err := r.js.Stream(ctx, r.cfg.CreateStream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		_, err = r.js.CreateStream(ctx, jetstream.StreamConfig{
			Name:       r.cfg.CreateStream,
			Subjects:   []string{subj},
			Storage:    jetstream.FileStorage,
			Duplicates: dup,
		})
		if err != nil {
			return fmt.Errorf("relay: create stream %q for %q: %w", r.cfg.CreateStream, subj, err)
		}
	case err != nil:
		return fmt.Errorf("relay: stream %q: %w", r.cfg.CreateStream, err)
	default:
		cfg := s.CachedInfo().Config
		if setting, reason := unusable(&cfg); setting != "" {
			return &StreamError{Subject: subj, Stream: cfg.Name, Err: ErrStreamUnusable, Setting: setting, Reason: reason}
		}
		if !slices.Contains(cfg.Subjects, subj) {
			cfg.Subjects = append(cfg.Subjects, subj)
		}
		if cfg.Duplicates < dup {
			cfg.Duplicates = dup
		}
		if _, err := r.js.UpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("relay: add %q to stream %q: %w", subj, r.cfg.CreateStream, err)
		}
	}
	r.log.Info("stream created or extended", "stream", r.cfg.CreateStream, "subject", subj, "duplicate_window", dup.String())
	return nil
}
