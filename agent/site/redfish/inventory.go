package redfish

import (
	"cmp"
	"context"
	"encoding/json"
	"math"
	"net"
	"sort"
	"strconv"
	"strings"

	gf "github.com/stmcginnis/gofish/redfish"
)

// maxField bounds every string the client copies out of a BMC's answer.
const maxField = 256

func bound(s string) string {
	s = strings.TrimSpace(s)
	if len(s) > maxField {
		s = s[:maxField]
	}
	return s
}

// Inventory reads the machine: identity, power state, processors, memory,
// Ethernet interfaces and drives (Storage, else SimpleStorage).
func (c *Client) Inventory(ctx context.Context) (*Inventory, error) {
	var inv *Inventory
	err := c.do(ctx, "inventory", func(ctx context.Context) error {
		sys, err := c.system()
		if err != nil {
			return err
		}
		inv = &Inventory{
			Manufacturer: bound(sys.Manufacturer),
			Model:        bound(sys.Model),
			SerialNumber: bound(sys.SerialNumber),
			UUID:         strings.ToLower(bound(sys.UUID)),
			PowerState:   PowerState(bound(string(sys.PowerState))),
			CPUCount:     sys.ProcessorSummary.Count,
			CPUModel:     bound(sys.ProcessorSummary.Model),
		}

		procs, err := sys.Processors()
		if err != nil {
			return err
		}
		sockets := 0
		for _, p := range procs[:min(len(procs), maxMembers)] {
			if p.ProcessorType != "" && p.ProcessorType != gf.CPUProcessorType {
				continue
			}
			sockets++
			inv.CPUCores += p.TotalCores
			if inv.CPUModel == "" {
				inv.CPUModel = bound(p.Model)
			}
		}
		if inv.CPUCount == 0 {
			inv.CPUCount = sockets
		}

		dimms, err := sys.Memory()
		if err != nil {
			return err
		}
		for _, d := range dimms[:min(len(dimms), maxMembers)] {
			inv.MemoryMiB += int64(d.CapacityMiB)
		}
		if inv.MemoryMiB == 0 {
			inv.MemoryMiB = int64(math.Round(float64(sys.MemorySummary.TotalSystemMemoryGiB) * 1024))
		}

		nics, err := sys.EthernetInterfaces()
		if err != nil {
			return err
		}
		for _, n := range nics[:min(len(nics), maxMembers)] {
			mac := cmp.Or(n.MACAddress, n.PermanentMACAddress)
			hw, err := net.ParseMAC(mac)
			if err != nil || len(hw) != 6 {
				c.log.WarnContext(ctx, "bmc reports an interface without a valid MAC", "nic", bound(n.ID))
				continue
			}
			inv.NICs = append(inv.NICs, NIC{ID: bound(n.ID), MAC: hw.String(), SpeedMbps: n.SpeedMbps})
		}

		disks, err := c.disks(sys)
		if err != nil {
			return err
		}
		inv.Disks = disks
		sort.Slice(inv.NICs, func(i, j int) bool { return inv.NICs[i].ID < inv.NICs[j].ID })
		sort.Slice(inv.Disks, func(i, j int) bool { return inv.Disks[i].ID < inv.Disks[j].ID })
		return nil
	})
	if err != nil {
		return nil, err
	}
	return inv, nil
}

// disks lists the drives of every Storage subsystem, falling back to
// SimpleStorage devices (which have no serial number).
func (c *Client) disks(sys *gf.ComputerSystem) ([]Disk, error) {
	var out []Disk
	storages, err := sys.Storage()
	if err != nil {
		return nil, err
	}
	for _, s := range storages[:min(len(storages), maxMembers)] {
		drives, err := s.Drives()
		if err != nil {
			return nil, err
		}
		for _, d := range drives[:min(len(drives), maxMembers)] {
			out = append(out, Disk{
				ID: bound(d.ID), Model: bound(d.Model), SerialNumber: bound(d.SerialNumber),
				CapacityBytes: d.CapacityBytes, MediaType: bound(string(d.MediaType)),
			})
		}
	}
	if len(storages) > 0 {
		return out, nil
	}
	simple, err := sys.SimpleStorages()
	if err != nil {
		return nil, err
	}
	for _, s := range simple[:min(len(simple), maxMembers)] {
		for i, d := range s.Devices[:min(len(s.Devices), maxMembers)] {
			out = append(out, Disk{
				ID: bound(s.ID) + "/" + strconv.Itoa(i), Model: bound(d.Model), CapacityBytes: d.CapacityBytes,
			})
		}
	}
	return out, nil
}

// allowableTargets reads Boot.BootSourceOverrideTarget@Redfish.AllowableValues
// from the system's raw JSON (gofish does not parse it).
func allowableTargets(raw []byte) []string {
	var v struct {
		Boot struct {
			Allowed []string `json:"BootSourceOverrideTarget@Redfish.AllowableValues"`
		}
	}
	if json.Unmarshal(raw, &v) != nil {
		return nil
	}
	return v.Boot.Allowed
}
