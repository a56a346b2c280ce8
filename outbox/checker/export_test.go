package checker

// OnForeign makes s call f when it has handled a request of another outbox (counted it and
// sent no answer).
func OnForeign(s *Server, f func(Request)) { s.onForeign.Store(&f) }
