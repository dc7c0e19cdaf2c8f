package config

import (
	"time"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Metal configures the metal role's workflow: the bare-metal flow's step
// deadlines and attempts, the ramdisk it boots and how it wipes.
type Metal struct {
	// StepTimeouts bounds one attempt of a step, by state name
	// ("inspecting", "booting-ramdisk", …); a step not named takes
	// [DefaultMetalStepTimeout] (booting-ramdisk and deploying longer).
	StepTimeouts map[string]Duration `yaml:"stepTimeouts"`
	// MaxAttempts is how many times a step is tried before the machine
	// fails; default 3.
	MaxAttempts int `yaml:"maxAttempts"`
	// Resync is how often every machine in the flow is looked at again,
	// bus or no bus; default 5s.
	Resync Duration `yaml:"resync"`
	// Ramdisk is the kernel and initrd of bcd ramdisk the site boots.
	Ramdisk MetalRamdisk `yaml:"ramdisk"`
	// WipeMethod is disk.wipe's: discard, zero (default) or secure-erase.
	WipeMethod string `yaml:"wipeMethod"`
}

// MetalRamdisk names the ramdisk's boot files, content-addressed.
type MetalRamdisk struct {
	KernelURL    string `yaml:"kernelUrl"`
	KernelSHA256 string `yaml:"kernelSha256"`
	InitrdURL    string `yaml:"initrdUrl"`
	InitrdSHA256 string `yaml:"initrdSha256"`
}

// DefaultMetalStepTimeout is a step's deadline when metal.stepTimeouts
// does not name it.
const DefaultMetalStepTimeout = 5 * time.Minute

// StepTimeout is the deadline of one attempt of step (a machine state).
func (c Metal) StepTimeout(step string) time.Duration {
	if d, ok := c.StepTimeouts[step]; ok && d > 0 {
		return d.Std()
	}
	switch step {
	case "booting-ramdisk", "rebooting":
		return 15 * time.Minute
	case "deploying", "wiping":
		return time.Hour
	}
	return DefaultMetalStepTimeout
}

func (c *Metal) defaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 3
	}
	if c.Resync == 0 {
		c.Resync = Duration(5 * time.Second)
	}
	if c.WipeMethod == "" {
		c.WipeMethod = "zero"
	}
}

func (c *Metal) validate() []error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	if c.MaxAttempts < 0 || c.MaxAttempts > 100 {
		bad("metal.maxAttempts", "1 to 100, got %d", c.MaxAttempts)
	}
	switch c.WipeMethod {
	case "", "discard", "zero", "secure-erase":
	default:
		bad("metal.wipeMethod", "%q: want discard, zero or secure-erase", c.WipeMethod)
	}
	for k, d := range c.StepTimeouts {
		if d < 0 || d.Std() > 24*time.Hour {
			bad("metal.stepTimeouts."+k, "0 to 24h, got %s", d.Std())
		}
	}
	if len(c.StepTimeouts) > 16 {
		bad("metal.stepTimeouts", "at most 16 steps")
	}
	return errs
}
