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

// logs.collect's sources: the daemon's own log (LogSourceBcd, also named
// LogSourceAgent), the kernel's ring buffer, the systemd journal and the
// NVIDIA driver's kernel messages.
const (
	LogSourceBcd     = "bcd"
	LogSourceAgent   = "agent"
	LogSourceKernel  = "kernel"
	LogSourceJournal = "journal"
	LogSourceNvidia  = "nvidia"
)

// LogSources are the names logs.collect accepts, in the order docs list
// them.
var LogSources = []string{LogSourceBcd, LogSourceAgent, LogSourceKernel, LogSourceJournal, LogSourceNvidia}

// LogSource returns the source name, the canonical one for an alias
// ("agent" is "bcd"), and whether it is known.
func LogSource(name string) (string, bool) {
	switch name {
	case LogSourceBcd, LogSourceAgent:
		return LogSourceBcd, true
	case LogSourceKernel, LogSourceJournal, LogSourceNvidia:
		return name, true
	}
	return "", false
}

const (
	// MaxLogUnits bounds logs.collect's units (the journal's filter).
	MaxLogUnits = 16
	// MaxLogUnit bounds one unit name, in bytes (systemd's own limit).
	MaxLogUnit = 256
)

// ValidUnit reports whether u may be passed to journalctl as a unit: 1 to
// MaxLogUnit bytes of systemd's unit-name characters (ASCII letters,
// digits, ":", "-", "_", ".", "\\", "@"), not starting with "-" (never an
// option).
func ValidUnit(u string) bool {
	if u == "" || len(u) > MaxLogUnit || u[0] == '-' {
		return false
	}
	for i := range len(u) {
		c := u[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == ':' || c == '-' || c == '_' || c == '.' || c == '\\' || c == '@':
		default:
			return false
		}
	}
	return true
}
