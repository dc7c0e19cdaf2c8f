package commandkinds

// Bounds of the payloads: the control plane refuses a command past them
// when it admits it (pkg/commands, INVALID_INPUT on the field) and the
// daemon checks them again before running it (agent/command,
// agent/ramdisk), so both read them from here.
const (
	// MaxWipeDisks bounds disk.wipe's disks.
	MaxWipeDisks = 64
	// MaxDiskPath bounds one device path (disk.wipe, image.deploy), in
	// characters.
	MaxDiskPath = 256
	// MaxURL bounds an image, kernel or initrd URL (image.deploy,
	// node.kexec), in characters.
	MaxURL = 2048
	// MaxKexecCmdline bounds node.kexec's cmdline, in characters.
	MaxKexecCmdline = 4096
	// MaxResetGPUs bounds gpu.reset's gpu_uuids.
	MaxResetGPUs = 64
	// MaxResetReason bounds gpu.reset's reason, in characters.
	MaxResetReason = 1024
	// MaxLogSources bounds logs.collect's sources.
	MaxLogSources = 16
	// DefaultLogsBytes is what logs.collect returns at most when max_bytes
	// is 0.
	DefaultLogsBytes = 1 << 20
	// MaxLogsBytes caps logs.collect's max_bytes.
	MaxLogsBytes = 4 << 20
)

// LogSourceAgent is logs.collect's source for the daemon's own log, the one
// source daemons collect today.
const LogSourceAgent = "agent"
