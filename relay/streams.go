package relay

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamError says which subject lacks a stream, or which stream's duplicate window is short.
type StreamError struct {
	Subject  string
	Stream   string
	Err      error // ErrNoStream or ErrDuplicateWindow
	Window   string
	Required string
}

func (e *StreamError) Error() string {
	if errors.Is(e.Err, ErrDuplicateWindow) {
		return fmt.Sprintf("%v: stream %q (capturing %q) keeps duplicates for %s, but the relay may republish up to %s later "+
			"(PublishTimeout + BackoffMax); raise the stream's duplicate window or lower BackoffMax", e.Err, e.Stream, e.Subject, e.Window, e.Required)
	}
	return fmt.Sprintf("%v %q: create a stream for it, or let the relay create one (CreateStream / --create-stream NAME)", e.Err, e.Subject)
}

func (e *StreamError) Unwrap() error { return e.Err }

// CheckStreams verifies that a stream captures each of Config.Subjects and that its duplicate
// window is at least RequiredDuplicateWindow, creating the stream Config.CreateStream names
// when a subject has none.
func (r *Relay) CheckStreams(ctx context.Context) error {
	required := r.cfg.RequiredDuplicateWindow()
	for _, subj := range r.cfg.Subjects {
		name, err := r.js.StreamNameBySubject(ctx, subj)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			if r.cfg.CreateStream == "" {
				return &StreamError{Subject: subj, Err: ErrNoStream}
			}
			if err := r.createStream(ctx, subj); err != nil {
				return err
			}
			name = r.cfg.CreateStream
		} else if err != nil {
			return fmt.Errorf("relay: look up the stream for %q: %w", subj, err)
		}
		s, err := r.js.Stream(ctx, name)
		if err != nil {
			return fmt.Errorf("relay: stream %q: %w", name, err)
		}
		if w := s.CachedInfo().Config.Duplicates; w < required {
			return &StreamError{Subject: subj, Stream: name, Err: ErrDuplicateWindow, Window: w.String(), Required: required.String()}
		}
	}
	return nil
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
