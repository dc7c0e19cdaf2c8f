// Package instancespec is the one rule for what a VPS instance's
// tenant-given fields may hold — its image, SSH keys, user data and host
// name — read by both sides of the wire: the API refuses at
// instances.create exactly what the host daemon (bcd's instances section)
// would refuse, so a bad value never reaches a host, and a host that still
// gets one fails only that instance.
//
// Each check returns nil or an error saying what is wrong, without the
// field's name: the API names its JSON field, the daemon its section's.
package instancespec

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Bounds of an instance's fields.
const (
	// MaxImageBytes is the longest image name.
	MaxImageBytes = 255
	// MaxSSHKeys is the most SSH keys of one instance.
	MaxSSHKeys = 32
	// MaxSSHKeyBytes is the longest SSH key.
	MaxSSHKeyBytes = 16 << 10
	// MaxUserDataBytes is the largest user data.
	MaxUserDataBytes = 64 << 10
	// MaxNetworkConfigBytes is the largest cloud-init network-config.
	MaxNetworkConfigBytes = 16 << 10
)

var (
	imageRE    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)
	hostnameRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)
)

// CheckImage accepts an image name: a file name the host resolves under its
// image directory — letters, digits, '.', '_' and '-', starting with a
// letter or digit (no '/', so no path leaves the directory), at most
// MaxImageBytes.
func CheckImage(image string) error {
	if len(image) > MaxImageBytes || !imageRE.MatchString(image) {
		return fmt.Errorf("%q is not an image name (letters, digits, '.', '_', '-', starting with a letter or digit; at most %d)", truncate(image, 80), MaxImageBytes)
	}
	return nil
}

// CheckSSHKeys accepts a list of SSH keys: at most MaxSSHKeys, each
// accepted by CheckSSHKey. The error names the first bad key by index.
func CheckSSHKeys(keys []string) error {
	if len(keys) > MaxSSHKeys {
		return fmt.Errorf("%d keys, at most %d", len(keys), MaxSSHKeys)
	}
	for i, k := range keys {
		if err := CheckSSHKey(k); err != nil {
			return fmt.Errorf("key %d: %w", i, err)
		}
	}
	return nil
}

// CheckSSHKey accepts one OpenSSH public key line: "<type> <key> [comment]"
// with a type of ssh-…, ecdsa-… or sk-…, printable UTF-8 without any
// control character (no tab, no line break), at most MaxSSHKeyBytes.
func CheckSSHKey(key string) error {
	if len(key) > MaxSSHKeyBytes {
		return fmt.Errorf("%d bytes, at most %d", len(key), MaxSSHKeyBytes)
	}
	if !utf8.ValidString(key) || strings.ContainsFunc(key, unicode.IsControl) {
		return errors.New("not a single line of printable text")
	}
	f := strings.Split(key, " ")
	typ := f[0]
	if !strings.HasPrefix(typ, "ssh-") && !strings.HasPrefix(typ, "ecdsa-") && !strings.HasPrefix(typ, "sk-") {
		return fmt.Errorf("key type %q: want ssh-…, ecdsa-… or sk-… (one OpenSSH public key line, \"ssh-ed25519 AAAA… comment\")", truncate(typ, 40))
	}
	if len(f) < 2 || f[1] == "" {
		return errors.New("no key after the type (one OpenSSH public key line, \"ssh-ed25519 AAAA… comment\")")
	}
	return nil
}

// CheckUserData accepts cloud-init user data: UTF-8 text without NUL, at
// most MaxUserDataBytes.
func CheckUserData(s string) error { return checkText(s, MaxUserDataBytes) }

// CheckNetworkConfig accepts a cloud-init network-config: UTF-8 text
// without NUL, at most MaxNetworkConfigBytes.
func CheckNetworkConfig(s string) error { return checkText(s, MaxNetworkConfigBytes) }

func checkText(s string, limit int) error {
	if len(s) > limit {
		return fmt.Errorf("%d bytes, at most %d", len(s), limit)
	}
	if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
		return errors.New("not UTF-8 text")
	}
	return nil
}

// CheckHostname accepts a guest host name: empty (from the instance id) or
// an RFC 1123 label of at most 63 characters.
func CheckHostname(s string) error {
	if s != "" && !hostnameRE.MatchString(s) {
		return fmt.Errorf("%q is not a host name (an RFC 1123 label of at most 63 characters)", truncate(s, 80))
	}
	return nil
}

// truncate cuts s to at most n bytes (on a rune boundary) for messages.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "…"
}
