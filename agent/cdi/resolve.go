package cdi

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// Resolution is what the CDI library, as a container engine runs it, makes
// of the devices a spec offers.
type Resolution struct {
	// Devices is how many names resolved to bcd's spec.
	Devices int
	// DeviceNodes is how many device nodes injecting them all gave an
	// OCI spec (0 when injection was not tried).
	DeviceNodes int
	// Problems say, per name, why an engine would not give it to a
	// container: unresolvable, resolved from another spec file (one of
	// higher priority overrides bcd's), a conflict, a spec file the
	// library refuses, or the injection failing.
	Problems []string
}

// Resolve resolves names (qualified: Kind=<name>) the way containerd,
// CRI-O, Podman and Docker do when a container asks for them: a fresh
// cache of the library over dirs (in the engine's order: a later
// directory overrides an earlier one) and InjectDevices into an empty OCI
// spec. Each name must resolve to SpecFile in one of dirs. With inject
// false (the node lacks some device nodes: a simulated node, already said
// by the spec's notes) only the lookup is checked, since injecting stats
// every host device node.
func Resolve(dirs, names []string, inject bool) (Resolution, error) {
	var res Resolution
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		return res, fmt.Errorf("cdi: %w", err)
	}
	ours := make([]string, len(dirs))
	for i, d := range dirs {
		ours[i] = filepath.Join(d, SpecFile)
	}
	// Errors of bcd's own files (a conflict names both files) say why a
	// name is missing.
	var fileErrs []string
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			if slices.Contains(ours, path) {
				fileErrs = append(fileErrs, e.Error())
			}
		}
	}
	slices.Sort(fileErrs)
	fileErrs = slices.Compact(fileErrs)
	for _, n := range names {
		d := cache.GetDevice(n)
		switch {
		case d == nil:
			why := "unresolvable"
			for _, e := range fileErrs {
				if strings.Contains(e, n) || !strings.Contains(e, "conflicting device") {
					why = e
					break
				}
			}
			res.Problems = append(res.Problems, n+": "+why)
		case !slices.Contains(ours, d.GetSpec().GetPath()):
			res.Problems = append(res.Problems, fmt.Sprintf("%s: resolves to %s, not bcd's spec", n, d.GetSpec().GetPath()))
		default:
			res.Devices++
		}
	}
	if inject && len(res.Problems) == 0 && len(names) > 0 {
		var spec oci.Spec
		if _, err := cache.InjectDevices(&spec, names...); err != nil {
			res.Problems = append(res.Problems, "injecting: "+err.Error())
		} else if spec.Linux != nil {
			res.DeviceNodes = len(spec.Linux.Devices)
		}
	}
	return res, nil
}
