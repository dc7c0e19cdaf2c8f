// Package seed builds an instance's cloud-init NoCloud seed: an ISO 9660
// image labelled "cidata" holding meta-data (instance-id, local-hostname),
// user-data and, when given, network-config. The user-data is our
// #cloud-config (the host name and the tenant's SSH keys) and then the
// tenant's own user data, as the second part of a multipart MIME document,
// merged by cloud-init. Nothing else goes in: no platform agent, no join
// token, no credential of ours ever runs inside a tenant's VM.
package seed

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"strings"

	"github.com/kdomanski/iso9660"

	"github.com/bettercompute/bettercompute/agent/vps"
)

// Label is the volume label cloud-init's NoCloud source looks for.
const Label = "cidata"

// The seed's files.
const (
	MetaDataFile      = "meta-data"
	UserDataFile      = "user-data"
	NetworkConfigFile = "network-config"
)

// MergeType is the Merge-Type of the tenant's #cloud-config part: its
// lists (ssh_authorized_keys among them) add to ours, its keys win.
const MergeType = "list(append)+dict(recurse_array)+str()"

// Files returns the seed's files for spec (validated with vps.Validate).
func Files(spec vps.Spec) (map[string][]byte, error) {
	if err := vps.Validate([]vps.Spec{withDefaults(spec)}); err != nil {
		return nil, fmt.Errorf("seed: %w", err)
	}
	host := spec.HostnameOrDefault()
	files := map[string][]byte{
		MetaDataFile: fmt.Appendf(nil, "instance-id: %s\nlocal-hostname: %s\n", quote(spec.ID), quote(host)),
		UserDataFile: userData(host, spec.SSHKeys, spec.UserData),
	}
	if spec.NetworkConfig != "" {
		files[NetworkConfigFile] = []byte(spec.NetworkConfig)
	}
	return files, nil
}

// withDefaults fills what Validate needs but a seed does not use.
func withDefaults(s vps.Spec) vps.Spec {
	if s.Power == "" {
		s.Power = vps.Running
	}
	if s.Image == "" {
		s.Image = "seed"
	}
	if s.Size == (vps.Size{}) {
		s.Size = vps.Size{VCPUs: 1, MemoryMiB: 1, DiskGiB: 1}
	}
	s.GPUs, s.GPUUUIDs = nil, nil
	return s
}

// quote writes s as a YAML double-quoted scalar (JSON's escapes are
// YAML's).
func quote(s string) string {
	b, _ := json.Marshal(s) // a string always marshals
	return string(b)
}

// ours is our #cloud-config: the host name and the SSH keys.
func ours(host string, keys []string) []byte {
	var b bytes.Buffer
	b.WriteString("#cloud-config\n")
	fmt.Fprintf(&b, "hostname: %s\npreserve_hostname: false\n", quote(host))
	if len(keys) > 0 {
		b.WriteString("ssh_authorized_keys:\n")
		for _, k := range keys {
			fmt.Fprintf(&b, "  - %s\n", quote(k))
		}
	}
	return b.Bytes()
}

// userData is ours alone, or a multipart MIME document of ours and the
// tenant's.
func userData(host string, keys []string, tenant string) []byte {
	own := ours(host, keys)
	if strings.TrimSpace(tenant) == "" {
		return own
	}
	sum := sha256.Sum256(append(append([]byte{}, own...), tenant...))
	boundary := "==BC" + hex.EncodeToString(sum[:12]) + "=="
	for strings.Contains(tenant, boundary) {
		sum = sha256.Sum256(sum[:])
		boundary = "==BC" + hex.EncodeToString(sum[:12]) + "=="
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "Content-Type: multipart/mixed; boundary=\"%s\"\nMIME-Version: 1.0\n\n", boundary)
	fmt.Fprintf(&b, "--%s\nContent-Type: text/cloud-config; charset=\"utf-8\"\nMIME-Version: 1.0\nContent-Disposition: attachment; filename=\"bettercompute.cfg\"\n\n", boundary)
	b.Write(own)
	ct, extra := contentType(tenant)
	fmt.Fprintf(&b, "\n--%s\nContent-Type: %s\nMIME-Version: 1.0\n%sContent-Disposition: attachment; filename=\"user-data\"\n\n", boundary, ct, extra)
	b.WriteString(tenant)
	if !strings.HasSuffix(tenant, "\n") {
		b.WriteByte('\n')
	}
	fmt.Fprintf(&b, "--%s--\n", boundary)
	return b.Bytes()
}

// contentType is the MIME type of the tenant's user data, from its first
// line as cloud-init reads it, and extra headers for the part.
func contentType(data string) (string, string) {
	first, _, _ := strings.Cut(data, "\n")
	first = strings.TrimSpace(first)
	switch {
	case strings.HasPrefix(first, "#cloud-config"):
		return `text/cloud-config; charset="utf-8"`, "Merge-Type: " + MergeType + "\n"
	case strings.HasPrefix(first, "#!"):
		return `text/x-shellscript; charset="utf-8"`, ""
	case strings.HasPrefix(first, "#include"):
		return `text/x-include-url; charset="utf-8"`, ""
	case strings.HasPrefix(first, "#cloud-boothook"):
		return `text/cloud-boothook; charset="utf-8"`, ""
	case strings.HasPrefix(strings.ToLower(first), "content-type:"):
		// A MIME document of the tenant's own: cloud-init walks nested
		// multiparts.
		return strings.TrimSpace(first[len("content-type:"):]), ""
	}
	return `text/plain; charset="utf-8"`, ""
}

// Build returns the seed ISO for spec.
func Build(spec vps.Spec) ([]byte, error) {
	files, err := Files(spec)
	if err != nil {
		return nil, err
	}
	w, err := iso9660.NewWriter()
	if err != nil {
		return nil, fmt.Errorf("seed: %w", err)
	}
	defer w.Cleanup() //nolint:errcheck // a staging directory
	for _, name := range []string{MetaDataFile, UserDataFile, NetworkConfigFile} {
		if data, ok := files[name]; ok {
			if err := w.AddFile(bytes.NewReader(data), name); err != nil {
				return nil, fmt.Errorf("seed: adding %s: %w", name, err)
			}
		}
	}
	var out bytes.Buffer
	if err := w.WriteTo(&out, Label); err != nil {
		return nil, fmt.Errorf("seed: writing the image: %w", err)
	}
	return out.Bytes(), nil
}

// MaxFileBytes bounds one file Read takes from an image.
const MaxFileBytes = 1 << 20

// Read returns the label and the files of a seed image (as Build made it).
func Read(image []byte) (string, map[string][]byte, error) {
	img, err := iso9660.OpenImage(bytes.NewReader(image))
	if err != nil {
		return "", nil, fmt.Errorf("seed: %w", err)
	}
	label, err := img.Label()
	if err != nil {
		return "", nil, fmt.Errorf("seed: %w", err)
	}
	root, err := img.RootDir()
	if err != nil {
		return "", nil, fmt.Errorf("seed: %w", err)
	}
	children, err := root.GetChildren()
	if err != nil {
		return "", nil, fmt.Errorf("seed: %w", err)
	}
	files := map[string][]byte{}
	for _, c := range children {
		if c.IsDir() {
			files[c.Name()+"/"] = nil
			continue
		}
		b, err := io.ReadAll(io.LimitReader(c.Reader(), MaxFileBytes+1))
		if err != nil {
			return "", nil, fmt.Errorf("seed: reading %s: %w", c.Name(), err)
		}
		if len(b) > MaxFileBytes {
			return "", nil, fmt.Errorf("seed: %s is over %d bytes", c.Name(), MaxFileBytes)
		}
		files[c.Name()] = b
	}
	return label, files, nil
}
