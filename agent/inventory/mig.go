package inventory

import (
	"context"
	"errors"
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

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

// MIGDevice is one MIG device (a compute instance) of a GPU.
type MIGDevice struct {
	// GPU is the parent GPU's UUID.
	GPU string
	// GI and CI are its GPU and compute instance ids.
	GI, CI int
}

// MIGDevices returns the MIG devices of every GPU in MIG mode, by MIG
// UUID, for the CDI spec.
func (c *Collector) MIGDevices(_ context.Context) (map[string]MIGDevice, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.open {
		return nil, errors.New("inventory: collector closed")
	}
	n, ret := c.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("inventory: device count: %s", nvml.ErrorString(ret))
	}
	out := map[string]MIGDevice{}
	for i := range n {
		d, ret := c.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: %s", i, nvml.ErrorString(ret))
		}
		if cur, _, ret := d.GetMigMode(); ret != nvml.SUCCESS || cur != nvml.DEVICE_MIG_ENABLE {
			continue
		}
		u, ret := d.GetUUID()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("inventory: gpu %d: uuid: %s", i, nvml.ErrorString(ret))
		}
		l, err := mig.Read(c.lib, u)
		if err != nil {
			return nil, fmt.Errorf("inventory: gpu %d: %w", i, err)
		}
		for _, in := range l.Instances {
			if in.UUID != "" {
				out[in.UUID] = MIGDevice{GPU: u, GI: in.GI, CI: in.CI}
			}
		}
	}
	return out, nil
}
