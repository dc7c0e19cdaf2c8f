package pxe

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/iana"
)

// phase is where a DHCP packet arrived: the DHCP port (67) or the PXE boot
// server port (4011).
type phase int

const (
	phaseDHCP phase = iota
	phasePXE
)

// PXE vendor options (option 43 sub-options, PXE spec 2.1 §2.4).
const (
	pxeDiscoveryControl = 6
	pxeBootItem         = 71
	// discoveryUseBootFile: "if a boot file name is present in the
	// ProxyDHCP offer, download it; no boot server discovery, no menu".
	discoveryUseBootFile = 0x08
)

// Vendor classes (option 60) the proxy answers.
const (
	classPXE  = "PXEClient"
	classHTTP = "HTTPClient"
)

// maxDHCPPacket bounds a received DHCP packet; larger ones are dropped.
const maxDHCPPacket = 1500

// proxyDHCP answers PXE clients' DHCP with boot information only; it never
// offers an address, so it lives beside the site's own DHCP server.
type proxyDHCP struct {
	ip       net.IP // our IPv4 address on the boot network
	machines Machines
	log      *slog.Logger
	bios     string // TFTP boot file for BIOS
	uefi     string // TFTP boot file for UEFI x64 (also HTTP boot)
	baseURL  func() string
}

// reply builds the answer to req and where to send it, or returns a
// reason it stays silent.
func (p *proxyDHCP) reply(ctx context.Context, req *dhcpv4.DHCPv4, ph phase, peer *net.UDPAddr) (*dhcpv4.DHCPv4, *net.UDPAddr, error) {
	if req.OpCode != dhcpv4.OpcodeBootRequest {
		return nil, nil, errors.New("not a BOOTREQUEST")
	}
	if req.HWType != iana.HWTypeEthernet || len(req.ClientHWAddr) != 6 {
		return nil, nil, errors.New("not an Ethernet client")
	}
	vendor := req.ClassIdentifier()
	httpBoot := strings.HasPrefix(vendor, classHTTP)
	if !httpBoot && !strings.HasPrefix(vendor, classPXE) {
		return nil, nil, errors.New("not a PXE client")
	}
	var respType dhcpv4.MessageType
	switch t := req.MessageType(); {
	case ph == phaseDHCP && t == dhcpv4.MessageTypeDiscover:
		respType = dhcpv4.MessageTypeOffer
	case ph == phaseDHCP && t == dhcpv4.MessageTypeRequest && p.ip.Equal(req.ServerIdentifier()):
		respType = dhcpv4.MessageTypeAck
	case ph == phasePXE && (t == dhcpv4.MessageTypeRequest || t == dhcpv4.MessageTypeInform):
		respType = dhcpv4.MessageTypeAck
	default:
		return nil, nil, errors.New("message type " + t.String() + " not for the proxy")
	}
	mac := req.ClientHWAddr
	if _, ok := p.machines.Lookup(ctx, mac); !ok {
		return nil, nil, errors.New("unknown MAC")
	}
	arch := clientArch(req, vendor)
	class := classPXE
	var file string
	var siaddr net.IP
	switch {
	case isIPXE(req):
		file = p.baseURL() + "/boot/" + mac.String() + ".ipxe"
	case httpBoot:
		if arch != iana.EFI_X86_64_HTTP {
			return nil, nil, errors.New("HTTP boot architecture " + arch.String() + " not served")
		}
		class = classHTTP
		file = p.baseURL() + "/ipxe/" + p.uefi
	case arch == iana.INTEL_X86PC:
		file, siaddr = p.bios, p.ip
	case arch == iana.EFI_X86_64 || arch == iana.EFI_BC:
		file, siaddr = p.uefi, p.ip
	default:
		return nil, nil, errors.New("architecture " + arch.String() + " not served")
	}

	mods := []dhcpv4.Modifier{
		dhcpv4.WithMessageType(respType),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(p.ip)),
		dhcpv4.WithOption(dhcpv4.OptClassIdentifier(class)),
		dhcpv4.WithOptionCopied(req, dhcpv4.OptionClientMachineIdentifier),
	}
	if class == classPXE {
		mods = append(mods, dhcpv4.WithGeneric(dhcpv4.OptionVendorSpecificInformation, pxeVendorOptions(req)))
	}
	if siaddr != nil {
		mods = append(mods, dhcpv4.WithServerIP(siaddr))
	}
	resp, err := dhcpv4.NewReplyFromRequest(req, mods...)
	if err != nil {
		return nil, nil, err
	}
	// A proxy never hands out an address: yiaddr stays 0.0.0.0 and no lease
	// options are set.
	resp.YourIPAddr = net.IPv4zero
	if respType == dhcpv4.MessageTypeAck && req.ClientIPAddr != nil {
		resp.ClientIPAddr = req.ClientIPAddr
	}
	resp.BootFileName = file
	if len(file) > 127 { // the fixed field holds 127 bytes
		resp.UpdateOption(dhcpv4.OptBootFileName(file))
	}
	return resp, p.dest(req, ph, peer), nil
}

// dest is where the reply goes: through the relay if there is one, back to
// the sender on the PXE port, else broadcast to the client port (the
// client has no address yet).
func (p *proxyDHCP) dest(req *dhcpv4.DHCPv4, ph phase, peer *net.UDPAddr) *net.UDPAddr {
	switch {
	case req.GatewayIPAddr != nil && !req.GatewayIPAddr.IsUnspecified():
		return &net.UDPAddr{IP: req.GatewayIPAddr, Port: dhcpv4.ServerPort}
	case ph == phasePXE && peer != nil && peer.IP != nil && !peer.IP.IsUnspecified():
		return peer
	case req.ClientIPAddr != nil && !req.ClientIPAddr.IsUnspecified():
		return &net.UDPAddr{IP: req.ClientIPAddr, Port: dhcpv4.ClientPort}
	default:
		return &net.UDPAddr{IP: net.IPv4bcast, Port: dhcpv4.ClientPort}
	}
}

// pxeVendorOptions is option 43: boot from the offered file without
// discovery, echoing the boot item a PXE-port request names.
func pxeVendorOptions(req *dhcpv4.DHCPv4) []byte {
	out := []byte{pxeDiscoveryControl, 1, discoveryUseBootFile}
	in := req.GetOneOption(dhcpv4.OptionVendorSpecificInformation)
	for len(in) >= 2 {
		code, n := in[0], int(in[1])
		if code == 0 { // pad
			in = in[1:]
			continue
		}
		if code == 255 || len(in) < 2+n {
			break
		}
		if code == pxeBootItem && n == 4 {
			out = append(out, in[:2+n]...)
		}
		in = in[2+n:]
	}
	return append(out, 255)
}

// isIPXE: iPXE sends user class "iPXE" (option 77), raw or RFC 3004.
func isIPXE(req *dhcpv4.DHCPv4) bool {
	if string(req.GetOneOption(dhcpv4.OptionUserClassInformation)) == "iPXE" {
		return true
	}
	for _, uc := range req.UserClass() {
		if uc == "iPXE" {
			return true
		}
	}
	return false
}

// clientArch is option 93's first architecture, else the one in the
// vendor class ("PXEClient:Arch:00007:UNDI:003016"), else BIOS.
func clientArch(req *dhcpv4.DHCPv4, vendor string) iana.Arch {
	if a := req.ClientArch(); len(a) > 0 {
		return a[0]
	}
	parts := strings.Split(vendor, ":")
	if len(parts) >= 3 && parts[1] == "Arch" {
		if n, err := strconv.ParseUint(parts[2], 10, 16); err == nil {
			return iana.Arch(n)
		}
	}
	return iana.INTEL_X86PC
}

// serve reads packets from conn until it is closed, answering each inline
// (a lookup and an encode: nothing to wait for).
func (p *proxyDHCP) serve(ctx context.Context, conn net.PacketConn, ph phase) {
	buf := make([]byte, maxDHCPPacket+1)
	for {
		n, addr, err := conn.ReadFrom(buf)
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				p.log.WarnContext(ctx, "proxy dhcp read", "error", err)
			}
			return
		}
		if n > maxDHCPPacket {
			continue
		}
		req, err := dhcpv4.FromBytes(buf[:n])
		if err != nil {
			p.log.DebugContext(ctx, "proxy dhcp: bad packet", "from", addr, "error", err)
			continue
		}
		peer, _ := addr.(*net.UDPAddr)
		resp, dst, err := p.reply(ctx, req, ph, peer)
		if err != nil {
			p.log.DebugContext(ctx, "proxy dhcp: ignored", "mac", req.ClientHWAddr.String(), "type", req.MessageType(), "reason", err)
			continue
		}
		if _, err := conn.WriteTo(resp.ToBytes(), dst); err != nil {
			p.log.WarnContext(ctx, "proxy dhcp write", "to", dst, "error", err)
			continue
		}
		p.log.InfoContext(ctx, "proxy dhcp: answered", "mac", req.ClientHWAddr.String(), "type", resp.MessageType(),
			"file", resp.BootFileName, "to", dst)
	}
}
