package sitetasks

import (
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/bettercompute/bettercompute/proto/credseal"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// validate checks t as Enqueue takes it.
func validate(t *Task) error {
	bad := func(field, format string, args ...any) error {
		return fault.New(fault.InvalidInput, field, format, args...)
	}
	switch {
	case t.TenantID == "" || len(t.TenantID) > MaxIDLen:
		return bad("tenantId", "tenantId is required, at most %d bytes", MaxIDLen)
	case t.SiteID == "" || len(t.SiteID) > MaxIDLen:
		return bad("siteId", "siteId is required, at most %d bytes", MaxIDLen)
	case t.MachineID == "" || len(t.MachineID) > MaxIDLen:
		return bad("machineId", "machineId is required, at most %d bytes", MaxIDLen)
	case len(t.ID) > MaxIDLen || (t.ID != "" && !strings.HasPrefix(t.ID, "stk_")):
		return bad("id", "a task id is stk_…, at most %d bytes", MaxIDLen)
	case t.NotAfter.IsZero():
		return bad("notAfter", "a site task needs a deadline (notAfter)")
	case time.Until(t.NotAfter) > MaxNotAfter:
		return bad("notAfter", "notAfter is at most %s away", MaxNotAfter)
	}
	p := t.Payload
	needSeal := false
	switch t.Kind {
	case KindBMCInspect, KindBMCPower, KindBMCBoot:
		needSeal = true
		if p.BMC == nil {
			return bad("payload.bmc", "%s needs the BMC", t.Kind)
		}
		if err := validBMC(*p.BMC); err != nil {
			return err
		}
		if p.MACs != nil || p.Decision != "" || p.Kernel != nil || p.Initrd != nil || p.Args != nil {
			return bad("payload", "%s takes only bmc and its action or target", t.Kind)
		}
		switch {
		case t.Kind == KindBMCPower && !oneOf(p.PowerAction, "on", "off", "cycle", "graceful-off"):
			return bad("payload.powerAction", "powerAction %q: want on, off, cycle or graceful-off", p.PowerAction)
		case t.Kind != KindBMCPower && p.PowerAction != "":
			return bad("payload.powerAction", "only bmc.power takes a powerAction")
		case t.Kind == KindBMCBoot && !oneOf(p.BootTarget, "pxe", "disk"):
			return bad("payload.bootTarget", "bootTarget %q: want pxe or disk", p.BootTarget)
		case t.Kind != KindBMCBoot && p.BootTarget != "":
			return bad("payload.bootTarget", "only bmc.boot takes a bootTarget")
		}
	case KindPXEArm, KindPXEDisarm:
		if p.BMC != nil || p.PowerAction != "" || p.BootTarget != "" {
			return bad("payload", "%s takes no BMC", t.Kind)
		}
		if len(p.MACs) == 0 || len(p.MACs) > MaxMACs {
			return bad("payload.macs", "1 to %d MACs", MaxMACs)
		}
		for i, m := range p.MACs {
			hw, err := net.ParseMAC(m)
			if err != nil || len(hw) != 6 {
				return bad("payload.macs", "macs[%d]: %q is not an Ethernet MAC", i, m)
			}
			p.MACs[i] = hw.String()
		}
		if t.Kind == KindPXEDisarm {
			if p.Decision != "" || p.Kernel != nil || p.Initrd != nil || p.Args != nil {
				return bad("payload", "pxe.disarm takes only macs")
			}
			break
		}
		switch p.Decision {
		case "local":
			if p.Kernel != nil || p.Initrd != nil || p.Args != nil {
				return bad("payload", "decision local takes no kernel, initrd or args")
			}
		case "ramdisk":
			needSeal = true
			for _, f := range []struct {
				field string
				img   *Image
			}{{"payload.kernel", p.Kernel}, {"payload.initrd", p.Initrd}} {
				field, img := f.field, f.img
				if img == nil || !validHex(img.SHA256) || !validURL(img.URL, "http", "https") {
					return bad(field, "%s: want {url: http(s)://…, sha256: 64 lowercase hex digits}", field)
				}
			}
			if len(p.Args) > MaxArgs {
				return bad("payload.args", "at most %d args", MaxArgs)
			}
		default:
			return bad("payload.decision", "decision %q: want ramdisk or local", p.Decision)
		}
	default:
		return fault.New(fault.Unsupported, "kind", "unknown site task kind %q", t.Kind)
	}
	switch {
	case needSeal && t.Sealed == "":
		return bad("sealed", "%s needs its secret sealed to the site's key (SealKey)", t.Kind)
	case !needSeal && t.Sealed != "":
		return bad("sealed", "%s carries no secret", t.Kind)
	case t.Sealed != "":
		kid, err := credseal.SealedKeyID(t.Sealed)
		if err != nil {
			return fault.Wrap(err, fault.InvalidInput, "sealed", "sealed: not a JWE of proto/credseal")
		}
		t.SealKID = kid
	default:
		t.SealKID = ""
	}
	return nil
}

func validBMC(b BMC) error {
	switch {
	case len(b.Address) > MaxURLLen || !validURL(b.Address, "https"):
		return fault.New(fault.InvalidInput, "payload.bmc.address", "want https://host[:port], at most %d bytes", MaxURLLen)
	case len(b.CAPEM) > MaxCAPEM:
		return fault.New(fault.InvalidInput, "payload.bmc.caPem", "at most %d bytes", MaxCAPEM)
	case b.Insecure && b.CAPEM != "":
		return fault.New(fault.InvalidInput, "payload.bmc.insecure", "insecure excludes a pinned caPem")
	case b.CertificateSHA256 != "" && !ValidSHA256(b.CertificateSHA256):
		return fault.New(fault.InvalidInput, "payload.bmc.certificateSha256", "want 64 lowercase hex digits")
	case b.Insecure && b.CertificateSHA256 != "":
		return fault.New(fault.InvalidInput, "payload.bmc.insecure", "insecure excludes a pinned certificate")
	case b.TrustOnFirstUse && (b.Insecure || b.CAPEM != "" || b.CertificateSHA256 != ""):
		return fault.New(fault.InvalidInput, "payload.bmc.trustOnFirstUse", "excludes insecure, caPem and certificateSha256")
	}
	return nil
}

// ValidSHA256 says s is a SHA-256 as 64 lowercase hex digits.
func ValidSHA256(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func validURL(s string, schemes ...string) bool {
	if s == "" || len(s) > MaxURLLen {
		return false
	}
	u, err := url.Parse(s)
	return err == nil && u.Host != "" && u.User == nil && oneOf(u.Scheme, schemes...)
}

func validHex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func oneOf(s string, set ...string) bool {
	for _, x := range set {
		if s == x {
			return true
		}
	}
	return false
}
