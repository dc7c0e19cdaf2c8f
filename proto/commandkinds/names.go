package commandkinds

// The kinds' names, as their payload messages declare them: the one Go home
// of the names both the control plane (pkg/commands) and the daemon
// (agent/command) queue and run by. TestNames keeps them equal to the
// declarations.
const (
	DiagNVML         = "diag.nvml"
	InventoryRefresh = "inventory.refresh"
	LogsCollect      = "logs.collect"
	NodeReboot       = "node.reboot"
	GPUReset         = "gpu.reset"
	DiskWipe         = "disk.wipe"
	ImageDeploy      = "image.deploy"
	NodeKexec        = "node.kexec"
	InstanceReboot   = "instance.reboot"
	AgentUpgrade     = "agent.upgrade"
)
