package reconcile

// Owned returns the shards whose leases role's worker holds, sorted.
func (rt *Runtime) Owned(role string) []int {
	rt.leaseMu.Lock()
	defer rt.leaseMu.Unlock()
	m := rt.member(role)
	if m == nil {
		return nil
	}
	return heldShardsLocked(m)
}

// HeldLeases returns the leases role's worker holds, by name.
func (rt *Runtime) HeldLeases(role string) map[string]int64 {
	rt.leaseMu.Lock()
	defer rt.leaseMu.Unlock()
	out := map[string]int64{}
	if m := rt.member(role); m != nil {
		for n, h := range m.held {
			out[n] = h.Fence
		}
	}
	return out
}
