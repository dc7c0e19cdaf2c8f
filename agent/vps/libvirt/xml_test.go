package libvirt_test

import (
	"context"
	"encoding/xml"
	"os"
	"slices"
	"testing"

	"github.com/bettercompute/bettercompute/agent/vps"
	"github.com/bettercompute/bettercompute/agent/vps/libvirt"
)

func spec(gpus ...string) vps.Spec {
	return vps.Spec{ID: "inst_x1", Generation: 7, Image: "ubuntu.qcow2", Power: vps.Running,
		Size: vps.Size{VCPUs: 8, MemoryMiB: 32768, DiskGiB: 100}, GPUs: gpus}
}

// raw is the rendered XML read with encoding/xml alone, so the test does
// not trust libvirtxml to read back what it wrote.
type raw struct {
	Name   string `xml:"name"`
	VCPU   uint   `xml:"vcpu"`
	Memory struct {
		Unit  string `xml:"unit,attr"`
		Value uint64 `xml:",chardata"`
	} `xml:"memory"`
	Devices struct {
		Disks []struct {
			Device string `xml:"device,attr"`
			Source struct {
				File string `xml:"file,attr"`
			} `xml:"source"`
		} `xml:"disk"`
		Interfaces []struct {
			Type string `xml:"type,attr"`
		} `xml:"interface"`
		Hostdevs []struct {
			Mode    string `xml:"mode,attr"`
			Type    string `xml:"type,attr"`
			Managed string `xml:"managed,attr"`
			Address struct {
				Domain   string `xml:"domain,attr"`
				Bus      string `xml:"bus,attr"`
				Slot     string `xml:"slot,attr"`
				Function string `xml:"function,attr"`
			} `xml:"source>address"`
		} `xml:"hostdev"`
	} `xml:"devices"`
}

func render(t *testing.T, s vps.Spec, o libvirt.DomainOptions) (string, raw) {
	t.Helper()
	x, err := libvirt.DomainXML(s, libvirt.Paths{Disk: "/var/lib/libvirt/images/bc-inst_x1.qcow2", Seed: "/var/lib/bc/seeds/bc-inst_x1-seed.iso"}, o)
	if err != nil {
		t.Fatal(err)
	}
	var r raw
	if err := xml.Unmarshal([]byte(x), &r); err != nil {
		t.Fatalf("%v\n%s", err, x)
	}
	return x, r
}

func TestDomainXML_HostdevsAreExactlyTheBookedGPUs(t *testing.T) {
	t.Parallel()
	for _, booked := range [][]string{nil, {"0000:18:00.0"}, {"0000:db:00.0", "0000:18:00.0", "0000:2a:00.1"}} {
		x, r := render(t, spec(booked...), libvirt.DomainOptions{})
		var got []string
		for _, h := range r.Devices.Hostdevs {
			if h.Mode != "subsystem" || h.Type != "pci" || h.Managed != "yes" {
				t.Errorf("hostdev mode=%q type=%q managed=%q, want subsystem/pci/yes", h.Mode, h.Type, h.Managed)
			}
			a := h.Address
			got = append(got, a.Domain+":"+a.Bus+":"+a.Slot+"."+a.Function)
		}
		want := []string{}
		for _, b := range booked {
			a, err := libvirt.ParsePCI(b)
			if err != nil {
				t.Fatal(err)
			}
			want = append(want, fmtHex(*a.Domain, 4)+":"+fmtHex(*a.Bus, 2)+":"+fmtHex(*a.Slot, 2)+"."+fmtHex(*a.Function, 1))
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("booked %v: hostdevs %v, want %v\n%s", booked, got, want, x)
		}
		d, err := libvirt.Describe(x)
		if err != nil {
			t.Fatal(err)
		}
		sortedBooked := slices.Sorted(slices.Values(booked))
		if !slices.Equal(d.GPUs, sortedBooked) && (len(d.GPUs) != 0 || len(booked) != 0) {
			t.Errorf("Describe GPUs %v, want %v", d.GPUs, sortedBooked)
		}
	}
}

func fmtHex(v uint, width int) string {
	const digits = "0123456789abcdef"
	b := make([]byte, width)
	for i := width - 1; i >= 0; i-- {
		b[i] = digits[v%16]
		v /= 16
	}
	return "0x" + string(b)
}

func TestDomainXML_SizeDisksNICAndMetadata(t *testing.T) {
	t.Parallel()
	x, r := render(t, spec(), libvirt.DomainOptions{NIC: libvirt.NIC{Mode: "bridge", Source: "br0"}})
	if r.Name != "bc-inst_x1" || r.VCPU != 8 || r.Memory.Value != 32768 || r.Memory.Unit != "MiB" {
		t.Errorf("name %q vcpu %d memory %d %s", r.Name, r.VCPU, r.Memory.Value, r.Memory.Unit)
	}
	if len(r.Devices.Disks) != 2 || r.Devices.Disks[0].Device != "disk" || r.Devices.Disks[1].Device != "cdrom" ||
		r.Devices.Disks[1].Source.File != "/var/lib/bc/seeds/bc-inst_x1-seed.iso" {
		t.Errorf("disks %+v", r.Devices.Disks)
	}
	if len(r.Devices.Interfaces) != 1 || r.Devices.Interfaces[0].Type != "bridge" {
		t.Errorf("interfaces %+v", r.Devices.Interfaces)
	}
	d, err := libvirt.Describe(x)
	if err != nil || d.Metadata == nil || d.Metadata.ID != "inst_x1" || d.Metadata.Generation != 7 || d.Size != spec().Size {
		t.Errorf("described %+v %v", d, err)
	}
	if _, r := render(t, spec(), libvirt.DomainOptions{}); r.Devices.Interfaces[0].Type != "user" {
		t.Errorf("default NIC %+v", r.Devices.Interfaces)
	}
	if _, err := libvirt.DomainXML(spec("not-an-address"), libvirt.Paths{}, libvirt.DomainOptions{}); err == nil {
		t.Error("rendered a bad PCI address")
	}
}

// TestRuntime_Libvirtd runs an instance through a real libvirtd when the
// host has one (with a "default" pool and an image in BC_TEST_LIBVIRT_IMAGE).
func TestRuntime_Libvirtd(t *testing.T) {
	if _, err := os.Stat(libvirt.DefaultSocket); err != nil {
		t.Skipf("no libvirtd: %s not found", libvirt.DefaultSocket)
	}
	image := os.Getenv("BC_TEST_LIBVIRT_IMAGE")
	if image == "" {
		t.Skip("libvirtd is here but BC_TEST_LIBVIRT_IMAGE (a path to a bootable image) is not set")
	}
	rt, err := libvirt.Connect(libvirt.Config{ImageDir: dirOf(image), SeedDir: t.TempDir(), Domain: libvirt.DomainOptions{Type: "qemu"}})
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	ctx := context.Background()
	s := spec()
	s.Image, s.Size = baseOf(image), vps.Size{VCPUs: 1, MemoryMiB: 256, DiskGiB: 2}
	t.Cleanup(func() { _ = rt.Delete(ctx, s.ID) })
	o, err := rt.Ensure(ctx, s)
	if err != nil || o.State != vps.Running {
		t.Fatalf("%+v %v", o, err)
	}
	list, err := rt.List(ctx)
	if err != nil || len(list) != 1 || list[0].ID != s.ID || list[0].Generation != 7 {
		t.Fatalf("%+v %v", list, err)
	}
	if err := rt.Delete(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
}

func dirOf(p string) string {
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' {
			return p[:i]
		}
	}
	return "."
}

func baseOf(p string) string { return p[len(dirOf(p))+1:] }
