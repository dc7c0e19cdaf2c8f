// Package spiffepath is the layout of the paths of the SPIFFE IDs
// (spiffe://<trust domain><path>) that the control plane's CA issues and
// that both sides check: a node's /node/<node id>, a site agent's
// /site/<site id>/agent/<agent id> and a gateway's /gateway/<name>. The
// control plane (pkg/nodeca, the gateway, joinservice) and bcd (agent/join,
// agent/session, agent/site, agent/state) read it from here, so neither
// imports the other.
package spiffepath

import "strings"

// The paths' prefixes.
const (
	// NodePrefix starts a node's path: /node/<node id>.
	NodePrefix = "/node/"
	// GatewayPrefix starts a gateway's path: /gateway/<name>.
	GatewayPrefix = "/gateway/"
	// SitePrefix starts a site agent's path: /site/<site id>/agent/<agent id>.
	SitePrefix = "/site/"
)

// Node returns a node's path, /node/<nodeID>.
func Node(nodeID string) string { return NodePrefix + nodeID }

// NodeID returns the node id of a node's path; ok is false for any other
// path (an empty id, or one with a "/").
func NodeID(path string) (nodeID string, ok bool) {
	rest, ok := strings.CutPrefix(path, NodePrefix)
	if !ok || rest == "" || strings.Contains(rest, "/") {
		return "", false
	}
	return rest, true
}

// SiteAgent returns a site agent's path, /site/<siteID>/agent/<agentID>.
func SiteAgent(siteID, agentID string) string { return SitePrefix + siteID + "/agent/" + agentID }

// SiteAgentIDs splits a site agent's path /site/<site id>/agent/<agent id>;
// ok is false for any other path.
func SiteAgentIDs(path string) (siteID, agentID string, ok bool) {
	rest, ok := strings.CutPrefix(path, SitePrefix)
	if !ok {
		return "", "", false
	}
	parts := strings.Split(rest, "/")
	if len(parts) != 3 || parts[0] == "" || parts[1] != "agent" || parts[2] == "" {
		return "", "", false
	}
	return parts[0], parts[2], true
}
