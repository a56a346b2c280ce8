package status

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// WriteText prints s as readable tables.
func WriteText(w io.Writer, s *Snapshot) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	p := func(format string, args ...any) { fmt.Fprintf(tw, format, args...) }
	p("outbox %q at %s: %d ready (%d due, %d retrying), oldest %s, %d dead (holding back %d ready), %d prepared; relays publish %.1f/s\n\n",
		s.Schema, s.At.Format(time.RFC3339), s.Totals.Ready, s.Totals.Due, s.Totals.Retrying,
		Age(s.Totals.OldestReadySeconds, s.Totals.Ready), s.Totals.Dead, s.Totals.Blocked, s.Totals.Prepared, s.Totals.PublishRate)

	p("SUBJECT\tREADY\tDUE\tRETRYING\tOLDEST READY\tDEAD\tPREPARED\tCHECK EXHAUSTED\n")
	for _, x := range s.Subjects {
		p("%s\t%d\t%d\t%d\t%s\t%d\t%d\t%d\n", x.Subject, x.Ready, x.Due, x.Retrying, Age(x.OldestReadySeconds, x.Ready), x.Dead, x.Prepared, x.CheckExhausted)
	}
	if len(s.Subjects) == 0 {
		p("(no unpublished rows)\t\t\t\t\t\t\t\n")
	}
	p("TOTAL\t%d\t%d\t%d\t%s\t%d\t%d\t%d\n\n", s.Totals.Ready, s.Totals.Due, s.Totals.Retrying,
		Age(s.Totals.OldestReadySeconds, s.Totals.Ready), s.Totals.Dead, s.Totals.Prepared, s.Totals.CheckExhausted)

	if len(s.Blocked) > 0 {
		p("BLOCKED KEY\tREADY HELD BACK\tBY DEAD ROW\tSUBJECT\tATTEMPTS\tLAST ERROR\n")
		for _, b := range s.Blocked {
			p("%s\t%d\t%s\t%s\t%d\t%s\n", b.Key, b.Ready, b.DeadMessageID, b.DeadSubject, b.DeadAttempts, oneLine(b.DeadLastError, 80))
		}
		p("\n")
	}

	p("RELAY\tSTATE\tHEALTH\tNATS\tPUBLISHED/S\tVERSION\tSTARTED\tLAST SEEN\tPARTITIONS HELD\n")
	for _, r := range s.Relays {
		state := "alive"
		if !r.Alive {
			state = "gone"
		}
		p("%s\t%s\t%s\t%s\t%.1f\t%s\t%s\t%s ago\t%s\n", r.RelayID, state, dash(r.Health), dash(r.NATS), r.PublishRate, dash(r.Version),
			r.StartedAt.Local().Format("2006-01-02 15:04:05"), Age(r.LastSeenSeconds, 1), Ranges(r.Held))
	}
	if len(s.Relays) == 0 {
		p("(no relay has run yet)\t\t\t\t\t\t\t\t\n")
	}
	p("\nPARTITION\tHOLDER\tREADY\tOLDEST READY\n")
	for _, x := range s.Partition {
		h := x.Holder
		if h == "" {
			h = "-"
		}
		p("%d/%d\t%s\t%d\t%s\n", x.Partition, s.Partitions, h, x.Ready, Age(x.OldestReadySeconds, x.Ready))
	}
	for _, t := range s.Panels {
		p("\n%s\n", strings.ToUpper(t.Title))
		p("%s\n", strings.Join(t.Columns, "\t"))
		for _, row := range t.Rows {
			p("%s\n", strings.Join(row, "\t"))
		}
		if t.Note != "" {
			p("%s\n", t.Note)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(s.Problems) > 0 {
		fmt.Fprintln(w)
		for _, pr := range s.Problems {
			fmt.Fprintf(w, "! %s\n", pr)
		}
	}
	return nil
}

// Age formats an age in seconds for people; "-" when there is nothing (n == 0).
func Age(sec float64, n int64) string {
	if n == 0 {
		return "-"
	}
	d := time.Duration(sec * float64(time.Second))
	switch {
	case d < time.Second:
		return strconv.Itoa(int(d/time.Millisecond)) + "ms"
	case d < time.Minute:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + "s"
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d/time.Minute), int(d%time.Minute/time.Second))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d/time.Hour), int(d%time.Hour/time.Minute))
	}
	return fmt.Sprintf("%dd%02dh", int(d/(24*time.Hour)), int(d%(24*time.Hour)/time.Hour))
}

// Ranges formats sorted partitions compactly: 0-3,6.
func Ranges(ps []int32) string {
	if len(ps) == 0 {
		return "-"
	}
	var b strings.Builder
	for i := 0; i < len(ps); {
		j := i
		for j+1 < len(ps) && ps[j+1] == ps[j]+1 {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		if j > i {
			fmt.Fprintf(&b, "%d-%d", ps[i], ps[j])
		} else {
			fmt.Fprintf(&b, "%d", ps[i])
		}
		i = j + 1
	}
	return b.String()
}

// dash is s, or "-" when it is empty (a relay older than migration 006 reports nothing).
func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine is s on one line, cut to at most n runes (with "…").
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}
