package relay

// Kill stops like a crashed process: the lease is left to expire.
func (s *Service) Kill() { s.stop(s.leader.Abandon) }
