package relay

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamError says which subject lacks a stream, or which stream's duplicate window is short.
type StreamError struct {
	Subject  string
	Stream   string
	Err      error // ErrNoStream or ErrDuplicateWindow
	Window   string
	Required string
	// Partial names the streams that capture only part of Subject (ErrNoStream).
	Partial []string
}

func (e *StreamError) Error() string {
	if errors.Is(e.Err, ErrDuplicateWindow) {
		return fmt.Sprintf("%v: stream %q (capturing %q) keeps duplicates for %s, but the relay may republish up to %s later "+
			"(PublishTimeout + BackoffMax); raise the stream's duplicate window or lower BackoffMax", e.Err, e.Stream, e.Subject, e.Window, e.Required)
	}
	if len(e.Partial) > 0 {
		return fmt.Sprintf("%v %q: stream(s) %s capture only part of it; give one stream a subject that covers it, or serve narrower subjects",
			e.Err, e.Subject, strings.Join(e.Partial, ", "))
	}
	return fmt.Sprintf("%v %q: create a stream for it, or let the relay create one (CreateStream / --create-stream NAME)", e.Err, e.Subject)
}

func (e *StreamError) Unwrap() error { return e.Err }

// CheckStreams verifies that one stream captures the whole of each of Config.Subjects (a
// stream that captures only part of a wildcard subject is not enough: the rest would fail
// message by message) and that every stream the subject's messages may land in keeps
// duplicates at least RequiredDuplicateWindow. It creates, or extends, the stream
// Config.CreateStream names when a subject has none.
func (r *Relay) CheckStreams(ctx context.Context) error {
	required := r.cfg.RequiredDuplicateWindow()
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
			if w := streams[name].Duplicates; w < required {
				return &StreamError{Subject: subj, Stream: name, Err: ErrDuplicateWindow, Window: w.String(), Required: required.String()}
			}
		}
	}
	return nil
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
		streams[n] = cfg
		for _, f := range cfg.Subjects {
			if covers(f, subj) {
				covering = n
			}
		}
	}
	return streams, covering, nil
}

// covers reports whether every subject that subj matches is also matched by filter.
func covers(filter, subj string) bool {
	f, s := strings.Split(filter, "."), strings.Split(subj, ".")
	for i, ft := range f {
		if ft == ">" {
			return i < len(s)
		}
		if i >= len(s) {
			return false
		}
		switch st := s[i]; {
		case st == ">":
			return false
		case ft == "*":
		case ft != st:
			return false
		}
	}
	return len(f) == len(s)
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
