package ops

import (
	"fmt"
	"html/template"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/status"
)

// Colors the page uses; the browser test looks for them in its screenshot.
const (
	ColorBar    = "#2b6cb0" // backlog bars
	ColorDead   = "#c53030" // the dead-rows card when there are dead rows
	ColorUnheld = "#e2e8f0" // a partition nobody holds
	ColorFlag   = "#dd3b3b" // what needs attention: a relay's bad health or NATS state, a flagged row's edge
)

// HolderColors color partitions by holder, in the order of the relays list.
var HolderColors = []string{"#2f855a", "#805ad5", "#dd6b20", "#d53f8c", "#319795", "#b7791f", "#4a5568", "#9c4221"}

type card struct {
	Label, Value, Sub string
	Alert             bool
}

type subjectRow struct {
	Name                   string
	Ready, Retrying        int64
	Dead, Prepared         int64
	BarPx                  int
	Oldest                 string
	OldestAlert, DeadAlert bool
}

type partCell struct {
	N      int32
	Color  string
	Title  string
	Ready  int64
	Unheld bool
}

type legendRow struct {
	Color, Name, Held, State string
	Alive                    bool
	// The fleet view: what the relay reported with its last heartbeat.
	Version, Health, NATS string
	Rate                  string
	HealthOK, NATSOK      bool
}

type blockedRow struct {
	Key, Subject, DeadID, LastError, Since string
	Ready                                  int64
	Attempts                               int32
}

type panelView struct {
	status.Table
	Lines []panelLine
}

type panelLine struct {
	Cells   []string
	Flagged bool
}

type pageData struct {
	Title    string
	Refresh  int
	At       string
	Self     *Self
	HealthOK bool
	Cards    []card
	Spark    string
	SparkMax string
	HasSpark bool
	Err      string
	Snap     *status.Snapshot
	Subjects []subjectRow
	Parts    []partCell
	Legend   []legendRow
	Blocked  []blockedRow
	Panels   []panelView
	Problems []string
	BarMax   int
	// The commands the blocked keys' note suggests, with --schema unless the outbox is in the
	// default.
	Requeue, Purge string
}

const barMaxPx = 320

func (s *Server) page(w http.ResponseWriter, r *http.Request) {
	snap, err := s.snapshot(r.Context())
	d := pageData{Title: "txoutbox relay", Refresh: int(s.cfg.Refresh / time.Second), At: time.Now().Format("2006-01-02 15:04:05 MST"), BarMax: barMaxPx}
	if d.Refresh < 1 {
		d.Refresh = 1
	}
	if s.cfg.Self != nil {
		me := s.cfg.Self()
		d.Self = &me
		d.Title = "txoutbox relay " + me.Name
		d.HealthOK = me.Health == "ok" || me.Health == "standby"
	}
	if err != nil {
		d.Err = err.Error()
	}
	tput := s.throughput(time.Minute)
	if snap != nil {
		d.Snap = snap
		t := snap.Totals
		d.Cards = append(d.Cards,
			card{Label: "Ready backlog", Value: strconv.FormatInt(t.Ready, 10), Sub: fmt.Sprintf("%d due, %d retrying", t.Due, t.Retrying)},
			card{Label: "Oldest ready", Value: status.Age(t.OldestReadySeconds, t.Ready), Sub: "age of the oldest waiting row", Alert: t.Ready > 0 && t.OldestReadySeconds > 60},
		)
		d.Cards = append(d.Cards, card{Label: "Throughput", Value: fmt.Sprintf("%.1f/s", tput), Sub: "published by this relay, last minute"})
		d.Cards = append(d.Cards, card{Label: "Fleet throughput", Value: fmt.Sprintf("%.1f/s", t.PublishRate), Sub: "all live relays, last minute"})
		d.Cards = append(d.Cards,
			card{Label: "Dead rows", Value: strconv.FormatInt(t.Dead, 10), Sub: fmt.Sprintf("holding back %d ready rows", t.Blocked), Alert: t.Dead > 0},
			card{Label: "Prepared", Value: strconv.FormatInt(t.Prepared, 10), Sub: fmt.Sprintf("half messages; %d check-exhausted", t.CheckExhausted), Alert: t.CheckExhausted > 0},
		)
		var maxReady int64
		for _, x := range snap.Subjects {
			maxReady = max(maxReady, x.Ready)
		}
		for _, x := range snap.Subjects {
			row := subjectRow{Name: x.Subject, Ready: x.Ready, Retrying: x.Retrying, Dead: x.Dead, Prepared: x.Prepared,
				Oldest: status.Age(x.OldestReadySeconds, x.Ready), OldestAlert: x.Ready > 0 && x.OldestReadySeconds > 60, DeadAlert: x.Dead > 0}
			if maxReady > 0 && x.Ready > 0 {
				row.BarPx = max(1, int(float64(barMaxPx)*float64(x.Ready)/float64(maxReady)+0.5))
			}
			d.Subjects = append(d.Subjects, row)
		}
		color := map[string]string{}
		alive := 0
		for _, rl := range snap.Relays {
			if !rl.Alive {
				continue
			}
			c := HolderColors[alive%len(HolderColors)]
			alive++
			color[rl.RelayID] = c
			d.Legend = append(d.Legend, legendRow{Color: c, Name: rl.RelayID, Held: status.Ranges(rl.Held), Alive: true,
				State:   fmt.Sprintf("%d held, seen %s ago", len(rl.Held), status.Age(rl.LastSeenSeconds, 1)),
				Version: orDash(rl.Version), Health: orDash(rl.Health), NATS: orDash(rl.NATS), Rate: fmt.Sprintf("%.1f/s", rl.PublishRate),
				HealthOK: rl.Health == "ok" || rl.Health == "standby", NATSOK: rl.NATS == "CONNECTED"})
		}
		for _, rl := range snap.Relays {
			if !rl.Alive {
				d.Legend = append(d.Legend, legendRow{Color: ColorUnheld, Name: rl.RelayID, Held: "-", State: "gone, last seen " + status.Age(rl.LastSeenSeconds, 1) + " ago",
					Version: orDash(rl.Version), Health: "-", NATS: "-", Rate: "-"})
			}
		}
		for _, b := range snap.Blocked {
			d.Blocked = append(d.Blocked, blockedRow{Key: b.Key, Subject: b.DeadSubject, DeadID: b.DeadMessageID.String(), LastError: b.DeadLastError,
				Since: status.Age(time.Since(b.DeadCreatedAt).Seconds(), 1), Ready: b.Ready, Attempts: b.DeadAttempts})
		}
		for _, p := range snap.Partition {
			c := partCell{N: p.Partition, Ready: p.Ready}
			if p.Holder == "" {
				c.Color, c.Unheld = ColorUnheld, true
				c.Title = fmt.Sprintf("partition %d: no holder, %d ready", p.Partition, p.Ready)
			} else {
				c.Color = color[p.Holder]
				if c.Color == "" {
					c.Color = "#718096"
				}
				c.Title = fmt.Sprintf("partition %d: %s, %d ready, oldest %s", p.Partition, p.Holder, p.Ready, status.Age(p.OldestReadySeconds, p.Ready))
			}
			d.Parts = append(d.Parts, c)
		}
		for _, t := range snap.Panels {
			v := panelView{Table: t}
			flagged := map[int]bool{}
			for _, i := range t.Flagged {
				flagged[i] = true
			}
			for i, row := range t.Rows {
				v.Lines = append(v.Lines, panelLine{Cells: row, Flagged: flagged[i]})
			}
			d.Panels = append(d.Panels, v)
		}
		d.Problems = snap.Problems
		d.Requeue = cmdline.Command(snap.Schema, "relay dead requeue --id", "ID")
		d.Purge = cmdline.Command(snap.Schema, "relay dead purge --id", "ID")
	} else {
		d.Cards = append(d.Cards, card{Label: "Throughput", Value: fmt.Sprintf("%.1f/s", tput), Sub: "published by this relay, last minute"})
	}
	if rates := s.rates(); len(rates) >= 2 {
		d.HasSpark = true
		peak := 0.0
		for _, x := range rates {
			peak = max(peak, x)
		}
		var pts []string
		for i, x := range rates {
			px := float64(i) * 600 / float64(maxSamples-2)
			py := 58.0
			if peak > 0 {
				py = 58 - 54*x/peak
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px, py))
		}
		d.Spark = strings.Join(pts, " ")
		d.SparkMax = fmt.Sprintf("%.1f/s", peak)
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := pageTmpl.Execute(w, d); err != nil {
		s.cfg.Logger.Warn("status page", "err", err)
	}
}

var pageTmpl = template.Must(template.New("page").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{{.Refresh}}">
<title>{{.Title}}</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;background:#f7fafc;color:#1a202c}
header{background:#1a202c;color:#fff;padding:14px 24px;display:flex;align-items:center;gap:16px}
header h1{font-size:18px;margin:0;font-weight:600}
header .meta{color:#a0aec0;font-size:13px;margin-left:auto}
.badge{padding:3px 10px;border-radius:12px;font-size:12px;font-weight:700;text-transform:uppercase}
.ok{background:#38a169;color:#fff}.bad{background:#e53e3e;color:#fff}
main{padding:20px 24px;max-width:1200px}
.cards{display:flex;gap:14px;flex-wrap:wrap;margin-bottom:18px}
.card{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:12px 16px;min-width:150px}
.card .label{color:#4a5568;font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:28px;font-weight:700;margin:2px 0}
.card .sub{color:#718096;font-size:12px}
.card.alert{background:` + ColorDead + `;border-color:` + ColorDead + `;color:#fff}
.card.alert .label,.card.alert .sub{color:#fed7d7}
section{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:14px 18px;margin-bottom:18px}
section h2{font-size:15px;margin:0 0 10px}
table{border-collapse:collapse;width:100%}
th{text-align:left;color:#4a5568;font-size:12px;text-transform:uppercase;border-bottom:1px solid #e2e8f0;padding:6px 8px}
td{padding:6px 8px;border-bottom:1px solid #edf2f7;font-variant-numeric:tabular-nums}
td.num{text-align:right}
.bar{height:14px;background:` + ColorBar + `;border-radius:0}
.warn{color:#c05621;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:6px;margin-bottom:12px}
.cell{width:44px;height:44px;border-radius:4px;color:#fff;font-size:12px;display:flex;flex-direction:column;align-items:center;justify-content:center;font-weight:600}
.cell small{font-weight:400;font-size:10px}
.cell.unheld{color:#4a5568;outline:2px dashed #a0aec0;outline-offset:-2px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:middle;margin-right:6px}
.problems{background:#fffaf0;border-color:#f6ad55}
.problems li{margin:2px 0}
.err{background:#fff5f5;border-color:#fc8181}
.muted{color:#718096}
.pill{padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.pill.good{background:#c6f6d5;color:#22543d}.pill.poor{background:` + ColorFlag + `;color:#fff}
.blocked{border-color:` + ColorFlag + `}
tr.flagged td{background:#fff5f5;color:#9b2c2c;font-weight:600}
tr.flagged td:first-child{border-left:4px solid ` + ColorFlag + `}
.lasterr{color:#9b2c2c;font-size:12px;max-width:340px;word-break:break-word}
code{font-size:12px}
</style></head>
<body>
<header><h1>{{.Title}}</h1>
{{with .Self}}<span class="badge {{if $.HealthOK}}ok{{else}}bad{{end}}">{{.Health}}</span>
<span>holds {{len .Held}} partitions (fair share {{.Target}}) &middot; {{.Relays}} live relay{{if ne .Relays 1}}s{{end}}</span>{{end}}
<span class="meta">{{with .Snap}}schema {{.Schema}} &middot; {{end}}{{.At}} &middot; refreshes every {{.Refresh}}s</span></header>
<main>
{{if .Err}}<section class="err"><h2>Cannot read the outbox</h2><p>{{.Err}}</p></section>{{end}}
{{if .Problems}}<section class="problems"><h2>Needs attention</h2><ul>{{range .Problems}}<li>{{.}}</li>{{end}}</ul></section>{{end}}
<div class="cards">{{range .Cards}}<div class="card{{if .Alert}} alert{{end}}"><div class="label">{{.Label}}</div><div class="value">{{.Value}}</div><div class="sub">{{.Sub}}</div></div>{{end}}</div>
{{if .HasSpark}}<section><h2>Published per second (this relay, peak {{.SparkMax}})</h2>
<svg width="600" height="60" viewBox="0 0 600 60" role="img" aria-label="throughput"><polyline fill="none" stroke="#3182ce" stroke-width="2" points="{{.Spark}}"/></svg></section>{{end}}
{{with .Snap}}
<section><h2>Backlog by subject</h2>
<table><tr><th>Subject</th><th>Ready</th><th style="width:{{$.BarMax}}px"></th><th>Oldest ready</th><th>Retrying</th><th>Dead</th><th>Prepared</th></tr>
{{range $.Subjects}}<tr><td>{{.Name}}</td><td class="num">{{.Ready}}</td><td><div class="bar" style="width:{{.BarPx}}px"></div></td><td class="{{if .OldestAlert}}warn{{end}}">{{.Oldest}}</td><td class="num">{{.Retrying}}</td><td class="num{{if .DeadAlert}} warn{{end}}">{{.Dead}}</td><td class="num">{{.Prepared}}</td></tr>
{{else}}<tr><td colspan="7" class="muted">Nothing waits: every row is published.</td></tr>{{end}}
</table></section>
<section><h2>Partitions ({{.Partitions}}) and their holders</h2>
<div class="grid">{{range $.Parts}}<div class="cell{{if .Unheld}} unheld{{end}}" style="background:{{.Color}}" title="{{.Title}}">{{.N}}<small>{{.Ready}}</small></div>{{end}}</div>
<p class="muted">Each square is a partition: its number and, below, its ready rows. Its color is its holder's; dashed means nobody holds it.</p>
</section>
<section id="fleet"><h2>Relays</h2>
<table><tr><th>Relay</th><th>Health</th><th>NATS</th><th>Published</th><th>Partitions</th><th>Version</th><th>State</th></tr>
{{range $.Legend}}<tr><td><span class="swatch" style="background:{{.Color}}"></span>{{.Name}}</td><td>{{if .Alive}}<span class="pill {{if .HealthOK}}good{{else}}poor{{end}}">{{.Health}}</span>{{else}}-{{end}}</td><td>{{if .Alive}}<span class="pill {{if .NATSOK}}good{{else}}poor{{end}}">{{.NATS}}</span>{{else}}-{{end}}</td><td class="num">{{.Rate}}</td><td>{{.Held}}</td><td>{{.Version}}</td><td>{{.State}}</td></tr>
{{else}}<tr><td colspan="7" class="muted">No relay is running.</td></tr>{{end}}</table>
<p class="muted">Every relay writes its health, NATS connection state, publish rate (last minute) and version with its heartbeat: this is the whole fleet, not only the relay serving this page.</p></section>
{{if $.Blocked}}<section id="blocked" class="blocked"><h2>Blocked keys</h2>
<table><tr><th>Key</th><th>Ready rows held back</th><th>Behind dead row</th><th>Subject</th><th>Attempts</th><th>Enqueued</th><th>Last error</th></tr>
{{range $.Blocked}}<tr><td><code>{{.Key}}</code></td><td class="num">{{.Ready}}</td><td><a href="/messages/{{.DeadID}}"><code>{{.DeadID}}</code></a></td><td>{{.Subject}}</td><td class="num">{{.Attempts}}</td><td>{{.Since}} ago</td><td class="lasterr">{{.LastError}}</td></tr>
{{end}}</table>
<p class="muted">The relay publishes a key's messages in order, so the ready rows of a key wait while an earlier row of the key is dead. Fix the cause, then <code>{{$.Requeue}}</code> (it goes out first) or <code>{{$.Purge}}</code>.</p></section>{{end}}
{{end}}
{{range .Panels}}<section><h2>{{.Title}}</h2><table><tr>{{range .Columns}}<th>{{.}}</th>{{end}}</tr>
{{range .Lines}}<tr{{if .Flagged}} class="flagged"{{end}}>{{range .Cells}}<td>{{.}}</td>{{end}}</tr>{{end}}</table>{{if .Note}}<p class="muted">{{.Note}}</p>{{end}}</section>{{end}}
<p class="muted">Read-only. <a href="/metrics">/metrics</a> &middot; <a href="/status.json">/status.json</a> &middot; <a href="/readyz">/readyz</a></p>
</main></body></html>`))

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
