package gateway

// Ready reports whether this gateway holds a session of nodeID that has
// been sent what was due at its start (its desired state, its in-flight and
// pending commands) and now reads the daemon's messages.
func (g *Gateway) Ready(nodeID string) bool {
	g.mu.Lock()
	s, ok := g.sessions[nodeID]
	g.mu.Unlock()
	return ok && s.ready.Load()
}
