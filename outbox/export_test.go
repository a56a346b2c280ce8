package outbox

// DoorbellClosing makes d signal when Close has refused later rings and starts waiting for a
// notify in flight; call it before Close.
func DoorbellClosing(d *PostgresDoorbell) <-chan struct{} {
	d.closing.Init()
	return d.closing.C()
}
