package inventory

import (
	"errors"

	"github.com/bettercompute/bettercompute/agent/mig"
)

// MIGLayout reads the MIG layout of the GPU with this UUID (package mig).
func (c *Collector) MIGLayout(uuid string) (mig.Layout, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return mig.Layout{}, errors.New("inventory: collector closed")
	}
	c.faults.Refresh() // the mock's MIG faults, from the faults file
	return mig.Read(c.lib, uuid)
}

// ApplyMIG applies one GPU's MIG layout (mig.Apply) and returns the layout
// the GPU then has and the changes made.
func (c *Collector) ApplyMIG(w mig.Want) (mig.Layout, []string, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return mig.Layout{GPU: w.GPU}, nil, errors.New("inventory: collector closed")
	}
	c.faults.Refresh()
	return mig.Apply(c.lib, w)
}
