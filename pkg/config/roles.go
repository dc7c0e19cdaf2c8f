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
	// RoleWorker is the spec's worker process mode: controllers,
	// scheduler, sinks and iam. It is a name for those roles, not a role
	// of its own: ParseRoles expands it.
	RoleWorker Role = "worker"
)

// roleTable is the one table of roles: every list of roles (here, in the
// reconciler runtime, in the lease names, in the app) derives from it. Its
// order is the stable order of every list.
var roleTable = []struct {
	role Role
	// built: this release has a service for the role; `all` runs the
	// built roles.
	built bool
	// membership: the role's reconcilers run on the reconciler runtime,
	// as a membership of their own, with their own shard leases.
	membership bool
	// includes are the finer roles a process naming this one also runs
	// (the spec's controllers are "reconcilers, workflows, the
	// CommandSweeper"); each keeps its own membership, so naming a finer
	// role alone still scales that part apart.
	includes []Role
}{
	{RoleAPI, true, false, nil},
	{RoleJoinService, true, false, nil},
	{RoleGateway, true, false, nil},
	{RoleNodeSpecController, true, true, nil},
	{RolePlacer, true, false, nil},
	{RoleCommandSweeper, true, true, nil},
	{RoleOutboxRelay, true, false, nil},
	{RoleControllers, true, true, []Role{RoleNodeSpecController, RoleCommandSweeper, RoleMetal, RoleVPS}},
	{RoleMetal, true, true, nil},
	{RoleVPS, true, true, nil},
	{RoleScheduler, true, true, []Role{RolePlacer}},
	{RoleSinks, true, false, []Role{RoleOutboxRelay}},
	{RoleIAM, true, true, nil},
}

// WorkerRoles are what [RoleWorker] names: the spec's worker process mode.
var WorkerRoles = []Role{RoleControllers, RoleScheduler, RoleSinks, RoleIAM}

// includes returns r's finer roles.
func includes(r Role) []Role {
	for _, t := range roleTable {
		if t.role == r {
			return t.includes
		}
	}
	return nil
}

// AllRoles lists every role except [RoleAll], in a stable order.
var AllRoles = rolesWhere(func(bool, bool) bool { return true })

// BuiltRoles lists the roles that have a service in this release, in the
// order of [AllRoles]. A role named explicitly that is not built fails at
// start; `all` runs these.
var BuiltRoles = rolesWhere(func(built, _ bool) bool { return built })

// RuntimeRoles lists the roles that are memberships of the reconciler
// runtime ("controllers", "scheduler", "nodespec-controller",
// "command-sweeper"), in the order of [AllRoles]: each has its own worker
// rows and shard leases.
var RuntimeRoles = rolesWhere(func(_, membership bool) bool { return membership })

func rolesWhere(keep func(built, membership bool) bool) []Role {
	var out []Role
	for _, r := range roleTable {
		if keep(r.built, r.membership) {
			out = append(out, r.role)
		}
	}
	return out
}

// ParseRoles parses role names; each entry may itself be a comma-separated
// list ("api,controllers"). Blank entries are ignored, duplicates collapse,
// and the result keeps the order of [AllRoles] with [RoleAll] kept as given
// (it is expanded by whoever knows which roles are built). "worker" is
// [WorkerRoles], and a role brings the finer roles it includes
// (controllers: nodespec-controller, command-sweeper, metal, vps;
// scheduler: placer; sinks: outbox-relay). No roles at all means
// [RoleAll]. An unknown name is INVALID_CONFIG on field "roles".
func ParseRoles(entries []string) ([]Role, error) {
	seen := map[Role]bool{}
	for _, e := range entries {
		for name := range strings.SplitSeq(e, ",") {
			name = strings.TrimSpace(name)
			if name == "" {
				continue
			}
			r := Role(strings.ToLower(name))
			switch {
			case r == RoleWorker:
				for _, w := range WorkerRoles {
					seen[w] = true
				}
				continue
			case r != RoleAll && !slices.Contains(AllRoles, r):
				return nil, fault.New(fault.InvalidConfig, "roles", "unknown role %q; expected %s", name, roleList())
			}
			seen[r] = true
		}
	}
	for changed := true; changed; {
		changed = false
		for r := range seen {
			for _, f := range includes(r) {
				if !seen[f] {
					seen[f], changed = true, true
				}
			}
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
	names = append(names, string(RoleWorker), string(RoleAll))
	return fmt.Sprintf("one of %s", strings.Join(names, ", "))
}
