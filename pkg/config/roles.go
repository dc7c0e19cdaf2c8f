package config

import (
	"fmt"
	"slices"
	"strings"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// Role is a part of the control plane a process can host (DESIGN §1). One
// configuration serves every process mode; `serve --roles` picks the roles.
type Role string

// The roles. The first ten are deployables; controllers, scheduler, sinks and
// iam are the spec's worker roles; all is every role this binary has.
const (
	RoleAPI                Role = "api"
	RoleJoinService        Role = "joinservice"
	RoleGateway            Role = "gateway"
	RoleNodeSpecController Role = "nodespec-controller"
	RolePlacer             Role = "placer"
	RoleCommandSweeper     Role = "command-sweeper"
	RoleOutboxRelay        Role = "outbox-relay"
	RoleControllers        Role = "controllers"
	RoleMetal              Role = "metal"
	RoleVPS                Role = "vps"
	RoleScheduler          Role = "scheduler"
	RoleSinks              Role = "sinks"
	RoleIAM                Role = "iam"
	RoleAll                Role = "all"
)

// AllRoles lists every role except [RoleAll], in a stable order.
var AllRoles = []Role{
	RoleAPI, RoleJoinService, RoleGateway, RoleNodeSpecController, RolePlacer,
	RoleCommandSweeper, RoleOutboxRelay, RoleControllers, RoleMetal, RoleVPS,
	RoleScheduler, RoleSinks, RoleIAM,
}

// ParseRoles parses role names; each entry may itself be a comma-separated
// list ("api,controllers"). Blank entries are ignored, duplicates collapse,
// and the result keeps the order of [AllRoles] with [RoleAll] kept as given
// (it is expanded by whoever knows which roles are built). No roles at all
// means [RoleAll]. An unknown name is INVALID_CONFIG on field "roles".
func ParseRoles(entries []string) ([]Role, error) {
	seen := map[Role]bool{}
	for _, e := range entries {
		for name := range strings.SplitSeq(e, ",") {
			name = strings.TrimSpace(name)
			if name == "" {
				continue
			}
			r := Role(strings.ToLower(name))
			if r != RoleAll && !slices.Contains(AllRoles, r) {
				return nil, fault.New(fault.InvalidConfig, "roles", "unknown role %q; expected %s", name, roleList())
			}
			seen[r] = true
		}
	}
	if len(seen) == 0 || seen[RoleAll] {
		return []Role{RoleAll}, nil
	}
	out := make([]Role, 0, len(seen))
	for _, r := range AllRoles {
		if seen[r] {
			out = append(out, r)
		}
	}
	return out, nil
}

func roleList() string {
	names := make([]string, 0, len(AllRoles)+1)
	for _, r := range AllRoles {
		names = append(names, string(r))
	}
	names = append(names, string(RoleAll))
	return fmt.Sprintf("one of %s", strings.Join(names, ", "))
}
