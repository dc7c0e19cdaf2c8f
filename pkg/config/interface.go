package config

// MCP configures the api role's Model Context Protocol server (at /mcp, and
// `better-compute mcp` on stdio).
type MCP struct {
	// ReadOnly offers only the read tools (nodes_list, nodes_get,
	// commands_get, reservations_get, capacity_get, events_list): an agent
	// connected to this server can look but not change anything, whatever
	// its key's policies allow.
	ReadOnly bool `yaml:"readOnly"`
}
