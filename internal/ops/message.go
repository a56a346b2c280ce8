package ops

import (
	"context"
	"errors"
	"html/template"
	"net/http"
	"sort"
	"time"

	"github.com/google/uuid"
	"github.com/txoutbox/txoutbox/internal/cmdline"
	"github.com/txoutbox/txoutbox/internal/status"
	"github.com/txoutbox/txoutbox/internal/store"
)

// message serves /messages/{id}: one outbox row as an operator needs it to decide (its
// state, subject, key, attempts, last error, header names and payload size). The page has no
// authentication, so it shows neither header values nor the payload: `relay dead show` does.
func (s *Server) message(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Message == nil {
		http.NotFound(w, r)
		return
	}
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		http.Error(w, "not a message id: "+err.Error(), http.StatusBadRequest)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	m, err := s.cfg.Message(ctx, id)
	switch {
	case errors.Is(err, store.ErrNoRow):
		http.Error(w, "no outbox row has message id "+id.String()+" (published, purged or requeued and published since?)", http.StatusNotFound)
		return
	case err != nil:
		http.Error(w, "cannot read the outbox: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	var names []string
	for k := range m.Headers {
		names = append(names, k)
	}
	sort.Strings(names)
	d := struct {
		M       *store.MessageDetail
		Age     string
		Headers []string
		Bytes   int
		Dead    bool
		// The commands that act on the row, with --schema unless the outbox is in the default.
		Requeue, Purge, Show string
	}{M: m, Age: status.Age(time.Since(m.CreatedAt).Seconds(), 1), Headers: names, Bytes: len(m.Payload), Dead: m.State == store.StateDead,
		Requeue: cmdline.Command(s.cfg.Schema, "relay dead requeue --id", id.String()),
		Purge:   cmdline.Command(s.cfg.Schema, "relay dead purge --id", id.String()),
		Show:    cmdline.Command(s.cfg.Schema, "relay dead show", id.String())}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	if err := messageTmpl.Execute(w, d); err != nil {
		s.cfg.Logger.Warn("message page", "err", err)
	}
}

var messageTmpl = template.Must(template.New("message").Parse(`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>message {{.M.MessageID}}</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;background:#f7fafc;color:#1a202c}
header{background:#1a202c;color:#fff;padding:14px 24px}header h1{font-size:18px;margin:0;font-weight:600}
main{padding:20px 24px;max-width:1000px}
section{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:14px 18px;margin-bottom:18px}
th{text-align:left;color:#4a5568;font-size:12px;text-transform:uppercase;padding:6px 12px 6px 0;vertical-align:top;width:160px}
td{padding:6px 0}
.err{color:#9b2c2c;white-space:pre-wrap;word-break:break-word}
.muted{color:#718096}code{font-size:13px}
</style></head>
<body><header><h1>Outbox message <code>{{.M.MessageID}}</code></h1></header>
<main><section><table>
<tr><th>State</th><td>{{.M.State}}</td></tr>
<tr><th>Subject</th><td><code>{{.M.Subject}}</code></td></tr>
<tr><th>Key</th><td>{{if .M.Key}}<code>{{.M.Key}}</code>{{else}}<span class="muted">none</span>{{end}}</td></tr>
<tr><th>Enqueued</th><td>{{.M.CreatedAt.Format "2006-01-02 15:04:05 MST"}} ({{.Age}} ago)</td></tr>
<tr><th>Attempts</th><td>{{.M.Attempts}}</td></tr>
<tr><th>Last error</th><td class="err">{{if .M.LastError}}{{.M.LastError}}{{else}}-{{end}}</td></tr>
{{if .M.Group}}<tr><th>Producer group</th><td>{{.M.Group}} ({{.M.CheckCount}} checks)</td></tr>{{end}}
<tr><th>Headers</th><td>{{range $i, $h := .Headers}}{{if $i}}, {{end}}<code>{{$h}}</code>{{else}}<span class="muted">none</span>{{end}}</td></tr>
<tr><th>Payload</th><td>{{.Bytes}} bytes</td></tr>
</table></section>
{{if .Dead}}<section><p>A dead row is never published on its own, and the later messages of its key wait behind it.
Fix the cause, then:</p>
<p><code>{{.Requeue}}</code> &nbsp;(it goes out before the rest of its key), or<br>
<code>{{.Purge}}</code> &nbsp;(deleted for good; the rest of its key goes out).</p>
<p class="muted"><code>{{.Show}}</code> prints the headers and the payload (this page has no authentication, so it does not).</p></section>{{end}}
<p class="muted"><a href="/">Back to the status page</a></p>
</main></body></html>`))
