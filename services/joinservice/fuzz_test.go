package joinservice

import (
	"bytes"
	"crypto/ecdh"
	"crypto/hpke"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

// fuzzKey is a fixed joinservice key, so the committed corpus's sealed
// tokens open.
func fuzzKey(tb testing.TB) *Key {
	tb.Helper()
	priv, err := ecdh.X25519().NewPrivateKey(bytes.Repeat([]byte{7}, 32))
	if err != nil {
		tb.Fatal(err)
	}
	k, err := newKey(priv)
	if err != nil {
		tb.Fatal(err)
	}
	return k
}

// fuzzToken and fuzzCSR are what the valid seeds seal.
const fuzzToken = "bcjt_fuzzseed"

var fuzzCSR = []byte("a csr")

// fuzzSeal seals token for csr to k the way bcd does.
func fuzzSeal(tb testing.TB, k *Key, token string, csr []byte) (enc, sealed []byte) {
	tb.Helper()
	pk, err := hpke.NewDHKEMPublicKey(k.priv.PublicKey())
	if err != nil {
		tb.Fatal(err)
	}
	enc, s, err := hpke.NewSender(pk, hpke.HKDFSHA256(), hpke.AES128GCM(), []byte(HPKEInfo))
	if err != nil {
		tb.Fatal(err)
	}
	if sealed, err = s.Seal(SealAAD(csr), []byte(token)); err != nil {
		tb.Fatal(err)
	}
	return enc, sealed
}

// FuzzKeyOpen opens Join's sealed token (encapsulated key, ciphertext, the
// CSR it is bound to) with garbled inputs: no panic, and anything but an
// authentic seal is refused. What opens must be one of the seeds' tokens:
// HPKE's AEAD lets nothing else through.
func FuzzKeyOpen(f *testing.F) {
	k := fuzzKey(f)
	enc, sealed := fuzzSeal(f, k, fuzzToken, fuzzCSR)
	f.Add(enc, sealed, fuzzCSR)
	f.Add(enc, sealed, []byte("another csr"))           // bound to another CSR
	f.Add(enc[:len(enc)-1], sealed, fuzzCSR)            // short encapsulated key
	f.Add(append(bytes.Clone(enc), 0), sealed, fuzzCSR) // long encapsulated key
	f.Add(enc, sealed[:len(sealed)-1], fuzzCSR)         // truncated tag
	f.Add(enc, append(bytes.Clone(sealed), 0), fuzzCSR) // trailing byte
	f.Add(make([]byte, len(enc)), sealed, fuzzCSR)      // the all-zero point
	f.Add([]byte{}, []byte{}, []byte{})
	f.Add(enc, []byte{}, fuzzCSR)
	f.Fuzz(func(t *testing.T, enc, sealed, csr []byte) {
		plain, err := k.Open(enc, sealed, csr)
		if err != nil {
			if plain != nil {
				t.Fatalf("Open failed (%v) but returned %q", err, plain)
			}
			return
		}
		if !strings.HasPrefix(string(plain), fuzzToken) {
			t.Fatalf("Open accepted a forged token: %q", plain)
		}
		if !bytes.Equal(csr, fuzzCSR) {
			t.Fatalf("a token sealed for %q opened for CSR %q", fuzzCSR, csr)
		}
	})
}

// FuzzHardwareClaims decodes Join's HardwareClaims and derives what Join
// does from them: no panic; claimsOf keeps every field; the hardware key is
// "hk_" and 64 hex digits, ignores the hostname and the GPUs' order, and
// the hardware-claims attestor's refusals are INVALID_INPUT faults.
func FuzzHardwareClaims(f *testing.F) {
	for _, c := range []*agentv1.HardwareClaims{
		{},
		{Hostname: "gpu-1", MachineId: "m1", SystemSerial: "SN1", Gpus: []*agentv1.GPU{
			{Uuid: "GPU-a", Model: "H100", Serial: "1", MemoryBytes: 80 << 30, PciBusId: "0000:01:00.0"},
			{Uuid: "GPU-b", Model: "H100"},
		}},
		{MachineId: "m1", SystemSerial: "To Be Filled By O.E.M."},
		{MachineId: " m1 ", Gpus: []*agentv1.GPU{{Uuid: "GPU-a"}, {Uuid: "GPU-a"}}},
		{MachineId: "m1", Gpus: []*agentv1.GPU{{}}},
	} {
		b, err := proto.Marshal(c)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0x22, 0xff}) // a GPU whose length runs past the end
	f.Fuzz(func(t *testing.T, b []byte) {
		var wire agentv1.HardwareClaims
		if err := proto.Unmarshal(b, &wire); err != nil {
			return
		}
		c := claimsOf(&wire)
		if c.Hostname != wire.GetHostname() || c.MachineID != wire.GetMachineId() || c.SystemSerial != wire.GetSystemSerial() || len(c.GPUs) != len(wire.GetGpus()) {
			t.Fatalf("claimsOf(%v) = %+v", &wire, c)
		}
		for i, g := range wire.GetGpus() {
			want := attest.GPU{UUID: g.GetUuid(), Model: g.GetModel(), Serial: g.GetSerial(), MemoryBytes: g.GetMemoryBytes(), PCIBusID: g.GetPciBusId()}
			if c.GPUs[i] != want {
				t.Fatalf("GPU %d: %+v, want %+v", i, c.GPUs[i], want)
			}
		}
		key := attest.HardwareKey(c)
		hexPart, ok := strings.CutPrefix(key, "hk_")
		if raw, err := hex.DecodeString(hexPart); !ok || err != nil || len(raw) != sha256.Size {
			t.Fatalf("hardware key %q: want hk_ and the hex of a SHA-256", key)
		}
		other := c
		other.Hostname += "-renamed"
		other.GPUs = slices.Clone(c.GPUs)
		slices.Reverse(other.GPUs)
		if got := attest.HardwareKey(other); got != key {
			t.Fatalf("the hardware key depends on the hostname or the GPUs' order: %s, %s", key, got)
		}
		if err := (attest.HardwareClaims{}).Attest(t.Context(), attest.Evidence{Claims: c}); err != nil {
			var fe *fault.Error
			if !errors.As(err, &fe) || fe.Code != fault.InvalidInput {
				t.Fatalf("Attest: %v, want an INVALID_INPUT fault", err)
			}
		}
	})
}
