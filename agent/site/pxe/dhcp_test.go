package pxe

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/iana"
)

var (
	knownMAC   = net.HardwareAddr{0x02, 0xbc, 0, 0, 0, 0x01}
	unknownMAC = net.HardwareAddr{0x02, 0xbc, 0, 0, 0, 0x99}
	serverIP   = net.IPv4(10, 213, 0, 1).To4()
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func setupProxy(t *testing.T) *proxyDHCP {
	t.Helper()
	tab := NewTable()
	if err := tab.Set(knownMAC, Decision{Action: BootLocal}); err != nil {
		t.Fatal(err)
	}
	return &proxyDHCP{
		ip:       serverIP,
		machines: tab,
		log:      quietLogger(),
		bios:     "undionly.kpxe",
		uefi:     "ipxe.efi",
		baseURL:  func() string { return "http://10.213.0.1:8080" },
	}
}

func discover(t *testing.T, mac net.HardwareAddr, mods ...dhcpv4.Modifier) *dhcpv4.DHCPv4 {
	t.Helper()
	d, err := dhcpv4.NewDiscovery(mac, mods...)
	if err != nil {
		t.Fatal(err)
	}
	// Round-trip through the wire format, as the server sees it.
	d, err = dhcpv4.FromBytes(d.ToBytes())
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func pxeClass(arch int) dhcpv4.Modifier {
	return dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:0000" + string(rune('0'+arch)) + ":UNDI:002001"))
}

// checkProxyOffer asserts what every proxy answer must be: no address, no
// lease, our identity, the boot file.
func checkProxyOffer(t *testing.T, resp *dhcpv4.DHCPv4, wantType dhcpv4.MessageType, wantClass, wantFile string, wantSiaddr net.IP) {
	t.Helper()
	resp, err := dhcpv4.FromBytes(resp.ToBytes())
	if err != nil {
		t.Fatal(err)
	}
	if resp.MessageType() != wantType {
		t.Errorf("message type = %s, want %s", resp.MessageType(), wantType)
	}
	if resp.OpCode != dhcpv4.OpcodeBootReply {
		t.Errorf("opcode = %s", resp.OpCode)
	}
	if !resp.YourIPAddr.Equal(net.IPv4zero) {
		t.Errorf("yiaddr = %s, want 0.0.0.0 (a proxy never hands out addresses)", resp.YourIPAddr)
	}
	for _, opt := range []dhcpv4.OptionCode{dhcpv4.OptionIPAddressLeaseTime, dhcpv4.OptionSubnetMask, dhcpv4.OptionRouter,
		dhcpv4.OptionDomainNameServer, dhcpv4.OptionRenewTimeValue, dhcpv4.OptionRebindingTimeValue} {
		if resp.Options.Has(opt) {
			t.Errorf("option %s present; a proxy sets no lease options", opt)
		}
	}
	if got := resp.ClassIdentifier(); got != wantClass {
		t.Errorf("option 60 = %q, want %q", got, wantClass)
	}
	if !resp.ServerIdentifier().Equal(serverIP) {
		t.Errorf("option 54 = %s, want %s", resp.ServerIdentifier(), serverIP)
	}
	if resp.BootFileName != wantFile {
		t.Errorf("boot file = %q, want %q", resp.BootFileName, wantFile)
	}
	if wantSiaddr == nil {
		wantSiaddr = net.IPv4zero
	}
	if !resp.ServerIPAddr.Equal(wantSiaddr) {
		t.Errorf("siaddr = %s, want %s", resp.ServerIPAddr, wantSiaddr)
	}
	opt43 := resp.GetOneOption(dhcpv4.OptionVendorSpecificInformation)
	if wantClass == classPXE {
		if !bytes.HasPrefix(opt43, []byte{6, 1, 8}) || opt43[len(opt43)-1] != 255 {
			t.Errorf("option 43 = % x, want discovery control 8 then end", opt43)
		}
	} else if opt43 != nil {
		t.Errorf("option 43 = % x on an HTTPClient answer", opt43)
	}
}

func TestProxyDHCPOffers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tests := []struct {
		name       string
		mods       []dhcpv4.Modifier
		wantClass  string
		wantFile   string
		wantSiaddr net.IP
	}{
		{"BIOS PXE gets undionly.kpxe over TFTP",
			[]dhcpv4.Modifier{pxeClass(0), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.INTEL_X86PC))},
			classPXE, "undionly.kpxe", serverIP},
		{"UEFI x64 PXE gets ipxe.efi over TFTP",
			[]dhcpv4.Modifier{pxeClass(7), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64))},
			classPXE, "ipxe.efi", serverIP},
		{"UEFI arch from the vendor class when option 93 is missing",
			[]dhcpv4.Modifier{pxeClass(7)},
			classPXE, "ipxe.efi", serverIP},
		{"UEFI HTTP boot gets the ipxe.efi URL",
			[]dhcpv4.Modifier{dhcpv4.WithOption(dhcpv4.OptClassIdentifier("HTTPClient:Arch:00016:UNDI:003001")),
				dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64_HTTP))},
			classHTTP, "http://10.213.0.1:8080/ipxe/ipxe.efi", nil},
		{"iPXE gets its per-machine script URL",
			[]dhcpv4.Modifier{pxeClass(7), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64)),
				dhcpv4.WithUserClass("iPXE", false)},
			classPXE, "http://10.213.0.1:8080/boot/02:bc:00:00:00:01.ipxe", nil},
		{"iPXE with an RFC 3004 user class",
			[]dhcpv4.Modifier{pxeClass(0), dhcpv4.WithUserClass("iPXE", true)},
			classPXE, "http://10.213.0.1:8080/boot/02:bc:00:00:00:01.ipxe", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := setupProxy(t)
			req := discover(t, knownMAC, tc.mods...)
			resp, dst, err := p.reply(ctx, req, phaseDHCP, &net.UDPAddr{IP: net.IPv4zero, Port: 68})
			if err != nil {
				t.Fatalf("no offer: %v", err)
			}
			checkProxyOffer(t, resp, dhcpv4.MessageTypeOffer, tc.wantClass, tc.wantFile, tc.wantSiaddr)
			if resp.TransactionID != req.TransactionID || !bytes.Equal(resp.ClientHWAddr, knownMAC) {
				t.Errorf("xid/chaddr not echoed: %s %s", resp.TransactionID, resp.ClientHWAddr)
			}
			if !dst.IP.Equal(net.IPv4bcast) || dst.Port != 68 {
				t.Errorf("sent to %s, want 255.255.255.255:68", dst)
			}
		})
	}
}

func TestProxyDHCPIgnores(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	tests := []struct {
		name string
		req  func(t *testing.T) *dhcpv4.DHCPv4
	}{
		{"a non-PXE client", func(t *testing.T) *dhcpv4.DHCPv4 {
			return discover(t, knownMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("MSFT 5.0")))
		}},
		{"a client without a vendor class", func(t *testing.T) *dhcpv4.DHCPv4 { return discover(t, knownMAC) }},
		{"an unknown MAC", func(t *testing.T) *dhcpv4.DHCPv4 {
			return discover(t, unknownMAC, pxeClass(0), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.INTEL_X86PC)))
		}},
		{"an unserved architecture (ARM64)", func(t *testing.T) *dhcpv4.DHCPv4 {
			return discover(t, knownMAC, dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00011:UNDI:003000")),
				dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_ARM64)))
		}},
		{"a REQUEST to another DHCP server", func(t *testing.T) *dhcpv4.DHCPv4 {
			return discover(t, knownMAC, pxeClass(0), dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest),
				dhcpv4.WithOption(dhcpv4.OptServerIdentifier(net.IPv4(10, 213, 0, 254))))
		}},
		{"a BOOTREPLY", func(t *testing.T) *dhcpv4.DHCPv4 {
			d := discover(t, knownMAC, pxeClass(0))
			d.OpCode = dhcpv4.OpcodeBootReply
			return d
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := setupProxy(t)
			if resp, _, err := p.reply(ctx, tc.req(t), phaseDHCP, nil); err == nil {
				t.Fatalf("answered: %s", resp.Summary())
			}
		})
	}
}

func TestProxyDHCPBootServerPort(t *testing.T) {
	t.Parallel()
	p := setupProxy(t)
	clientIP := net.IPv4(10, 213, 0, 50)
	req := discover(t, knownMAC, pxeClass(7), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64)),
		dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest), dhcpv4.WithClientIP(clientIP),
		dhcpv4.WithGeneric(dhcpv4.OptionVendorSpecificInformation, []byte{71, 4, 0x80, 0x00, 0, 0, 255}))
	peer := &net.UDPAddr{IP: clientIP, Port: 4011}
	resp, dst, err := p.reply(context.Background(), req, phasePXE, peer)
	if err != nil {
		t.Fatal(err)
	}
	checkProxyOffer(t, resp, dhcpv4.MessageTypeAck, classPXE, "ipxe.efi", serverIP)
	if got := resp.GetOneOption(dhcpv4.OptionVendorSpecificInformation); !bytes.Equal(got, []byte{6, 1, 8, 71, 4, 0x80, 0, 0, 0, 255}) {
		t.Errorf("option 43 = % x, want the boot item echoed", got)
	}
	if !resp.ClientIPAddr.Equal(clientIP) {
		t.Errorf("ciaddr = %s", resp.ClientIPAddr)
	}
	if dst.String() != peer.String() {
		t.Errorf("sent to %s, want %s", dst, peer)
	}
	// A DISCOVER on the boot server port is not for it.
	if _, _, err := p.reply(context.Background(), discover(t, knownMAC, pxeClass(0)), phasePXE, peer); err == nil {
		t.Error("answered a DISCOVER on port 4011")
	}
}

func TestProxyDHCPRelayed(t *testing.T) {
	t.Parallel()
	p := setupProxy(t)
	relay := net.IPv4(10, 9, 0, 1)
	req := discover(t, knownMAC, pxeClass(0), dhcpv4.WithGatewayIP(relay))
	resp, dst, err := p.reply(context.Background(), req, phaseDHCP, &net.UDPAddr{IP: relay, Port: 67})
	if err != nil {
		t.Fatal(err)
	}
	if !dst.IP.Equal(relay) || dst.Port != 67 {
		t.Errorf("sent to %s, want the relay %s:67", dst, relay)
	}
	if !resp.GatewayIPAddr.Equal(relay) {
		t.Errorf("giaddr = %s", resp.GatewayIPAddr)
	}
}

// TestProxyDHCPOverUDP runs the started server's boot-server port on
// loopback and sends it a real REQUEST (port 67 answers are broadcast:
// TestNetnsDHCPExchange covers them).
func TestProxyDHCPOverUDP(t *testing.T) {
	t.Parallel()
	h := setup(t)
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	req := discover(t, knownMAC, pxeClass(0), dhcpv4.WithMessageType(dhcpv4.MessageTypeRequest),
		dhcpv4.WithClientIP(net.IPv4(127, 0, 0, 1)))
	if _, err := conn.WriteTo(req.ToBytes(), h.srv.Addrs().PXE); err != nil {
		t.Fatal(err)
	}
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	buf := make([]byte, 1500)
	n, _, err := conn.ReadFrom(buf)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	resp, err := dhcpv4.FromBytes(buf[:n])
	if err != nil {
		t.Fatal(err)
	}
	if resp.TransactionID != req.TransactionID || resp.MessageType() != dhcpv4.MessageTypeAck || resp.BootFileName != "undionly.kpxe" {
		t.Fatalf("answer: %s", resp.Summary())
	}
}

// FuzzProxyDHCP feeds arbitrary packets to the proxy: it must never panic,
// and whatever it answers must hand out no address.
func FuzzProxyDHCP(f *testing.F) {
	for _, mods := range [][]dhcpv4.Modifier{
		{dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient:Arch:00000:UNDI:002001"))},
		{dhcpv4.WithOption(dhcpv4.OptClassIdentifier("HTTPClient:Arch:00016")), dhcpv4.WithOption(dhcpv4.OptClientArch(iana.EFI_X86_64_HTTP))},
		{dhcpv4.WithOption(dhcpv4.OptClassIdentifier("PXEClient")), dhcpv4.WithUserClass("iPXE", false),
			dhcpv4.WithGeneric(dhcpv4.OptionVendorSpecificInformation, []byte{0, 71, 4, 1, 2, 3, 4, 6, 9})},
	} {
		d, err := dhcpv4.NewDiscovery(knownMAC, mods...)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(d.ToBytes(), false)
		f.Add(d.ToBytes(), true)
	}
	tab := NewTable()
	if err := tab.Set(knownMAC, Decision{Action: BootLocal}); err != nil {
		f.Fatal(err)
	}
	p := &proxyDHCP{ip: serverIP, machines: tab, log: quietLogger(), bios: "undionly.kpxe", uefi: "ipxe.efi",
		baseURL: func() string { return "http://10.213.0.1" }}
	f.Fuzz(func(t *testing.T, b []byte, pxePort bool) {
		req, err := dhcpv4.FromBytes(b)
		if err != nil {
			return
		}
		ph := phaseDHCP
		if pxePort {
			ph = phasePXE
		}
		resp, _, err := p.reply(context.Background(), req, ph, &net.UDPAddr{IP: net.IPv4(10, 213, 0, 9), Port: 68})
		if err != nil {
			return
		}
		if !resp.YourIPAddr.Equal(net.IPv4zero) {
			t.Fatalf("yiaddr %s", resp.YourIPAddr)
		}
		_ = resp.ToBytes()
	})
}
