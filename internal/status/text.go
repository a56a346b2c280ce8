package status

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/txoutbox/txoutbox/internal/safetext"
)

// WriteText prints s as readable tables. Text from outside the relay (subjects, keys, last
// errors, relay ids, versions, panel cells, problems) is printed through safetext.Printable,
// tabs escaped in table cells, so that it cannot act on the operator's terminal or forge rows.
func WriteText(w io.Writer, s *Snapshot) error {
	c := func(v string) string { return safetext.Printable(v, true) }
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	p := func(format string, args ...any) { fmt.Fprintf(tw, format, args...) }
	p("outbox %q at %s: %d ready (%d due, %d retrying), oldest %s, %d dead (holding back %d ready), %d prepared; relays publish %.1f/s\n\n",
		c(s.Schema), s.At.Format(time.RFC3339), s.Totals.Ready, s.Totals.Due, s.Totals.Retrying,
		Age(s.Totals.OldestReadySeconds, s.Totals.Ready), s.Totals.Dead, s.Totals.Blocked, s.Totals.Prepared, s.Totals.PublishRate)

	p("SUBJECT\tREADY\tDUE\tRETRYING\tOLDEST READY\tDEAD\tPREPARED\tCHECK EXHAUSTED\n")
	for _, x := range s.Subjects {
		p("%s\t%d\t%d\t%d\t%s\t%d\t%d\t%d\n", c(x.Subject), x.Ready, x.Due, x.Retrying, Age(x.OldestReadySeconds, x.Ready), x.Dead, x.Prepared, x.CheckExhausted)
	}
	if len(s.Subjects) == 0 {
		p("(no unpublished rows)\t\t\t\t\t\t\t\n")
	}
	p("TOTAL\t%d\t%d\t%d\t%s\t%d\t%d\t%d\n\n", s.Totals.Ready, s.Totals.Due, s.Totals.Retrying,
		Age(s.Totals.OldestReadySeconds, s.Totals.Ready), s.Totals.Dead, s.Totals.Prepared, s.Totals.CheckExhausted)

	if len(s.Blocked) > 0 {
		p("BLOCKED KEY\tREADY HELD BACK\tBY DEAD ROW\tSUBJECT\tATTEMPTS\tLAST ERROR\n")
		for _, b := range s.Blocked {
			p("%s\t%d\t%s\t%s\t%d\t%s\n", c(b.Key), b.Ready, b.DeadMessageID, c(b.DeadSubject), b.DeadAttempts, c(oneLine(b.DeadLastError, 80)))
		}
		p("\n")
	}

	p("RELAY\tSTATE\tHEALTH\tNATS\tPUBLISHED/S\tVERSION\tSTARTED\tLAST SEEN\tPARTITIONS HELD\n")
	for _, r := range s.Relays {
		state := "alive"
		if !r.Alive {
			state = "gone"
		}
		p("%s\t%s\t%s\t%s\t%.1f\t%s\t%s\t%s ago\t%s\n", c(r.RelayID), state, c(dash(r.Health)), c(dash(r.NATS)), r.PublishRate, c(dash(r.Version)),
			r.StartedAt.Local().Format("2006-01-02 15:04:05"), Age(r.LastSeenSeconds, 1), Ranges(r.Held))
	}
	if len(s.Relays) == 0 {
		// A relay that stopped cleanly removed its row: an empty list says nothing of the past.
		p("(no relay is running)\t\t\t\t\t\t\t\t\n")
	}
	p("\nPARTITION\tHOLDER\tREADY\tOLDEST READY\n")
	for _, x := range s.Partition {
		h := c(x.Holder)
		if h == "" {
			h = "-"
		}
		p("%d/%d\t%s\t%d\t%s\n", x.Partition, s.Partitions, h, x.Ready, Age(x.OldestReadySeconds, x.Ready))
	}
	for _, t := range s.Panels {
		p("\n%s\n", strings.ToUpper(t.Title))
		p("%s\n", strings.Join(t.Columns, "\t"))
		for _, row := range t.Rows {
			cells := make([]string, len(row))
			for i, v := range row {
				cells[i] = c(v)
			}
			p("%s\n", strings.Join(cells, "\t"))
		}
		if t.Note != "" {
			p("%s\n", safetext.Printable(t.Note, false))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(s.Problems) > 0 {
		fmt.Fprintln(w)
		for _, pr := range s.Problems {
			fmt.Fprintf(w, "! %s\n", safetext.Printable(pr, false))
		}
	}
	return nil
}

// Age formats an age in seconds for people; "-" when there is nothing (n == 0). It works on
// the seconds, not a time.Duration, whose range (about 292 years) a delivery time up to
// 9999-12-31 exceeds: such a time is shown in days. A negative age (a clock step) is 0ms.
func Age(sec float64, n int64) string {
	if n == 0 {
		return "-"
	}
	switch {
	case !(sec >= 0): // negative, NaN
		sec = 0
	case sec > maxAgeSeconds:
		sec = maxAgeSeconds
	}
	if sec < 1 {
		return strconv.Itoa(int(sec*1000)) + "ms"
	}
	if sec < 60 {
		return strconv.FormatFloat(sec, 'f', 1, 64) + "s"
	}
	s := int64(sec)
	switch {
	case s < 3600:
		return fmt.Sprintf("%dm%02ds", s/60, s%60)
	case s < 48*3600:
		return fmt.Sprintf("%dh%02dm", s/3600, s%3600/60)
	}
	return fmt.Sprintf("%dd%02dh", s/86400, s%86400/3600)
}

// maxAgeSeconds bounds what Age formats (about 317,000 years: past any delivery time).
const maxAgeSeconds = 1e13

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
