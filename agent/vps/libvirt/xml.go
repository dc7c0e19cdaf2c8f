// Package libvirt is the VPS runtime on libvirt/QEMU: one persistent
// domain per instance, named "bc-<id>", with its vCPUs and memory, a qcow2
// root disk (a copy-on-write overlay of the image, in a libvirt storage
// pool), the NoCloud seed (vps/seed) as a cdrom, one user-mode or bridged
// NIC, and the booked GPUs passed through by PCI address (VFIO, managed):
// exactly those, no other host device. The runtime talks to libvirtd over
// its unix socket (github.com/digitalocean/go-libvirt) and only touches
// domains that carry its metadata.
package libvirt

import (
	"encoding/xml"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"libvirt.org/go/libvirtxml"

	"github.com/bettercompute/bettercompute/agent/vps"
)

// Namespace is the XML namespace of the runtime's domain metadata.
const Namespace = "https://bettercompute.com/xmlns/vps/1"

// DomainPrefix starts the name of every domain the runtime manages.
const DomainPrefix = "bc-"

// DomainName is the domain of instance id.
func DomainName(id string) string { return DomainPrefix + id }

// Metadata is what the runtime keeps in a domain's <metadata>.
type Metadata struct {
	XMLName    xml.Name  `xml:"https://bettercompute.com/xmlns/vps/1 instance"`
	ID         string    `xml:"id"`
	Generation int64     `xml:"generation"`
	Image      string    `xml:"image"`
	DiskGiB    uint32    `xml:"disk-gib"`
	Power      vps.State `xml:"power"`
}

// NIC is how instances reach the network.
type NIC struct {
	// Mode is "user" (QEMU's user-mode networking; the default),
	// "bridge" (Source is a host bridge) or "network" (Source is a
	// libvirt network).
	Mode string
	// Source is the bridge or network name.
	Source string
	// Model is the NIC model; empty means "virtio".
	Model string
}

// Paths are the files a domain uses.
type Paths struct {
	// Disk is the root disk (the qcow2 overlay).
	Disk string
	// Seed is the NoCloud seed ISO.
	Seed string
}

// DomainOptions are the host-wide parts of every domain.
type DomainOptions struct {
	// Type is the domain type: "kvm" (the default) or "qemu" (TCG).
	Type string
	// Machine is the machine type; empty means "q35".
	Machine string
	// NIC is the network interface.
	NIC NIC
}

// ParsePCI parses "dddd:bb:ss.f".
func ParsePCI(addr string) (*libvirtxml.DomainAddressPCI, error) {
	dom, rest, ok1 := strings.Cut(addr, ":")
	bus, rest, ok2 := strings.Cut(rest, ":")
	slot, fn, ok3 := strings.Cut(rest, ".")
	if !ok1 || !ok2 || !ok3 {
		return nil, fmt.Errorf("%q is not a PCI address (dddd:bb:ss.f)", addr)
	}
	var v [4]uint
	for i, s := range []string{dom, bus, slot, fn} {
		n, err := strconv.ParseUint(s, 16, 16)
		if err != nil {
			return nil, fmt.Errorf("%q is not a PCI address: %w", addr, err)
		}
		v[i] = uint(n)
	}
	return &libvirtxml.DomainAddressPCI{Domain: &v[0], Bus: &v[1], Slot: &v[2], Function: &v[3]}, nil
}

// FormatPCI formats a PCI address as "dddd:bb:ss.f".
func FormatPCI(a *libvirtxml.DomainAddressPCI) string {
	u := func(p *uint) uint {
		if p == nil {
			return 0
		}
		return *p
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", u(a.Domain), u(a.Bus), u(a.Slot), u(a.Function))
}

// Domain renders the domain of spec (validated and resolved).
func Domain(spec vps.Spec, p Paths, o DomainOptions) (*libvirtxml.Domain, error) {
	md, err := xml.Marshal(Metadata{ID: spec.ID, Generation: spec.Generation, Image: spec.Image, DiskGiB: spec.Size.DiskGiB, Power: spec.Power})
	if err != nil {
		return nil, err
	}
	one := uint(0)
	d := &libvirtxml.Domain{
		Type:     cmpOr(o.Type, "kvm"),
		Name:     DomainName(spec.ID),
		Metadata: &libvirtxml.DomainMetadata{XML: string(md)},
		Memory:   &libvirtxml.DomainMemory{Value: uint(spec.Size.MemoryMiB), Unit: "MiB"},
		VCPU:     &libvirtxml.DomainVCPU{Value: uint(spec.Size.VCPUs)},
		OS: &libvirtxml.DomainOS{
			Type:        &libvirtxml.DomainOSType{Arch: "x86_64", Machine: cmpOr(o.Machine, "q35"), Type: "hvm"},
			BootDevices: []libvirtxml.DomainBootDevice{{Dev: "hd"}},
		},
		Features: &libvirtxml.DomainFeatureList{ACPI: &libvirtxml.DomainFeature{}, APIC: &libvirtxml.DomainFeatureAPIC{}},
		OnReboot: "restart", OnCrash: "destroy", OnPoweroff: "destroy",
		Devices: &libvirtxml.DomainDeviceList{
			Disks: []libvirtxml.DomainDisk{
				{
					Device: "disk",
					Driver: &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "qcow2"},
					Source: &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: p.Disk}},
					Target: &libvirtxml.DomainDiskTarget{Dev: "vda", Bus: "virtio"},
				},
				{
					Device:   "cdrom",
					Driver:   &libvirtxml.DomainDiskDriver{Name: "qemu", Type: "raw"},
					Source:   &libvirtxml.DomainDiskSource{File: &libvirtxml.DomainDiskSourceFile{File: p.Seed}},
					Target:   &libvirtxml.DomainDiskTarget{Dev: "sda", Bus: "sata"},
					ReadOnly: &libvirtxml.DomainDiskReadOnly{},
				},
			},
			Serials:  []libvirtxml.DomainSerial{{Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}}, Target: &libvirtxml.DomainSerialTarget{Port: &one}}},
			Consoles: []libvirtxml.DomainConsole{{Source: &libvirtxml.DomainChardevSource{Pty: &libvirtxml.DomainChardevSourcePty{}}, Target: &libvirtxml.DomainConsoleTarget{Type: "serial", Port: &one}}},
		},
	}
	nic := libvirtxml.DomainInterface{Model: &libvirtxml.DomainInterfaceModel{Type: cmpOr(o.NIC.Model, "virtio")}}
	switch o.NIC.Mode {
	case "", "user":
		nic.Source = &libvirtxml.DomainInterfaceSource{User: &libvirtxml.DomainInterfaceSourceUser{}}
	case "bridge":
		nic.Source = &libvirtxml.DomainInterfaceSource{Bridge: &libvirtxml.DomainInterfaceSourceBridge{Bridge: o.NIC.Source}}
	case "network":
		nic.Source = &libvirtxml.DomainInterfaceSource{Network: &libvirtxml.DomainInterfaceSourceNetwork{Network: o.NIC.Source}}
	default:
		return nil, fmt.Errorf("NIC mode %q: want user, bridge or network", o.NIC.Mode)
	}
	d.Devices.Interfaces = []libvirtxml.DomainInterface{nic}
	gpus := slices.Clone(spec.GPUs)
	slices.Sort(gpus)
	for _, g := range slices.Compact(gpus) {
		addr, err := ParsePCI(g)
		if err != nil {
			return nil, err
		}
		d.Devices.Hostdevs = append(d.Devices.Hostdevs, libvirtxml.DomainHostdev{
			Managed:   "yes",
			SubsysPCI: &libvirtxml.DomainHostdevSubsysPCI{Source: &libvirtxml.DomainHostdevSubsysPCISource{Address: addr}},
		})
	}
	return d, nil
}

// DomainXML renders the domain of spec as libvirt XML.
func DomainXML(spec vps.Spec, p Paths, o DomainOptions) (string, error) {
	d, err := Domain(spec, p, o)
	if err != nil {
		return "", err
	}
	return d.Marshal()
}

// Described is what Describe reads back from a domain's XML.
type Described struct {
	// Metadata is the runtime's metadata; nil for a domain not ours.
	Metadata *Metadata
	// Size is the vCPUs, memory and (from the metadata) disk.
	Size vps.Size
	// GPUs are the PCI host devices, sorted.
	GPUs []string
}

// Describe reads a domain's XML.
func Describe(domainXML string) (Described, error) {
	var d libvirtxml.Domain
	if err := d.Unmarshal(domainXML); err != nil {
		return Described{}, err
	}
	var out Described
	if d.Metadata != nil {
		// <metadata> may hold other applications' elements too.
		dec := xml.NewDecoder(strings.NewReader("<m>" + d.Metadata.XML + "</m>"))
		var wrap struct {
			Instances []Metadata `xml:"https://bettercompute.com/xmlns/vps/1 instance"`
		}
		if err := dec.Decode(&wrap); err == nil && len(wrap.Instances) == 1 {
			out.Metadata = &wrap.Instances[0]
		}
	}
	if d.VCPU != nil {
		out.Size.VCPUs = uint32(d.VCPU.Value)
	}
	if d.Memory != nil {
		out.Size.MemoryMiB = toMiB(uint64(d.Memory.Value), d.Memory.Unit)
	}
	if out.Metadata != nil {
		out.Size.DiskGiB = out.Metadata.DiskGiB
	}
	if d.Devices != nil {
		for _, h := range d.Devices.Hostdevs {
			if h.SubsysPCI != nil && h.SubsysPCI.Source != nil && h.SubsysPCI.Source.Address != nil {
				out.GPUs = append(out.GPUs, FormatPCI(h.SubsysPCI.Source.Address))
			}
		}
	}
	slices.Sort(out.GPUs)
	return out, nil
}

// toMiB converts a libvirt memory value in unit to MiB.
func toMiB(v uint64, unit string) uint64 {
	switch strings.ToLower(unit) {
	case "b", "bytes":
		return v >> 20
	case "mib", "m":
		return v
	case "gib", "g":
		return v << 10
	case "tib", "t":
		return v << 20
	}
	return v >> 10 // KiB, libvirt's default
}

// DiskPath is where the root disk of id lives in a pool directory.
func DiskPath(poolDir, id string) string { return filepath.Join(poolDir, DomainName(id)+".qcow2") }

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
