package commandkinds

// The levels diag.nvml takes (DiagNvml.level; "" is DiagLevelQuick).
const (
	// DiagLevelQuick reads NVML only (the default).
	DiagLevelQuick = "quick"
	// DiagLevelMedium also runs DCGM's diagnostics at run level 2.
	DiagLevelMedium = "medium"
	// DiagLevelLong also runs DCGM's diagnostics at run level 3.
	DiagLevelLong = "long"
	// DiagLevelFull is another name for DiagLevelLong.
	DiagLevelFull = "full"
)

// DiagLevels are the levels diag.nvml accepts, in the order docs list them.
var DiagLevels = []string{DiagLevelQuick, DiagLevelMedium, DiagLevelLong, DiagLevelFull}

// DiagRunLevel is the DCGM run level (dcgmi diag -r) diag.nvml runs at a
// level: 0 for quick (NVML only) and "", 2 for medium, 3 for long and
// full. ok is false for a level diag.nvml does not know.
func DiagRunLevel(level string) (runLevel int, ok bool) {
	switch level {
	case "", DiagLevelQuick:
		return 0, true
	case DiagLevelMedium:
		return 2, true
	case DiagLevelLong, DiagLevelFull:
		return 3, true
	}
	return 0, false
}

// HealthDiagRunLevel is the DCGM run level the health section's periodic
// diagnostics run at its diagnostics_level (HealthSettings: "the DCGM
// diagnostics level"): 1 for quick and "", 2 for medium, 3 for long. ok is
// false for any other level.
func HealthDiagRunLevel(level string) (runLevel int, ok bool) {
	switch level {
	case "", DiagLevelQuick:
		return 1, true
	case DiagLevelMedium:
		return 2, true
	case DiagLevelLong:
		return 3, true
	}
	return 0, false
}
