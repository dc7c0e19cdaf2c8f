package attest_test

import (
	"context"
	"testing"

	"github.com/bettercompute/bettercompute/pkg/attest"
	"github.com/bettercompute/bettercompute/pkg/fault"
)

func h200s(uuids ...string) []attest.GPU {
	var out []attest.GPU
	for _, u := range uuids {
		out = append(out, attest.GPU{UUID: u, Model: "NVIDIA H200"})
	}
	return out
}

func TestHardwareKey(t *testing.T) {
	t.Parallel()
	base := attest.Claims{MachineID: "m1", SystemSerial: "SN1", GPUs: h200s("GPU-a", "GPU-b")}
	key := attest.HardwareKey(base)

	reinstalled := base
	reinstalled.MachineID = "m2"
	reordered := base
	reordered.GPUs = h200s("GPU-b", "GPU-a")
	if attest.HardwareKey(reinstalled) != key || attest.HardwareKey(reordered) != key {
		t.Fatal("a new machine id or GPU order must not change the key")
	}
	swapped := base
	swapped.GPUs = h200s("GPU-a", "GPU-c")
	if attest.HardwareKey(swapped) == key {
		t.Fatal("other GPUs must change the key")
	}
	// Without a usable serial the machine id tells machines apart.
	a := attest.Claims{MachineID: "m1", SystemSerial: "To Be Filled By O.E.M."}
	b := attest.Claims{MachineID: "m2", SystemSerial: "To Be Filled By O.E.M."}
	if attest.HardwareKey(a) == attest.HardwareKey(b) {
		t.Fatal("placeholder serials must not collide")
	}
}

func TestChain(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	good := attest.Claims{MachineID: "m1", SystemSerial: "SN1", GPUs: h200s("GPU-a", "GPU-b")}
	for _, tc := range []struct {
		name   string
		claims attest.Claims
		expect attest.Expect
		code   fault.Code
		field  string
	}{
		{"meets every expectation", good, attest.Expect{GPUCount: 2, GPUModel: "h200", SystemSerial: "SN1"}, "", ""},
		{"no machine id", attest.Claims{}, attest.Expect{}, fault.InvalidInput, "claims.machineId"},
		{"duplicate GPU", attest.Claims{MachineID: "m", GPUs: h200s("GPU-a", "GPU-a")}, attest.Expect{}, fault.InvalidInput, "claims.gpus"},
		{"wrong GPU count", good, attest.Expect{GPUCount: 8}, fault.AccessDenied, "claims"},
		{"wrong GPU model", good, attest.Expect{GPUModel: "B200"}, fault.AccessDenied, "claims"},
		{"model expected, no GPUs", attest.Claims{MachineID: "m"}, attest.Expect{GPUModel: "H200"}, fault.AccessDenied, "claims"},
		{"wrong serial", good, attest.Expect{SystemSerial: "SN2"}, fault.AccessDenied, "claims"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := attest.DefaultChain().Attest(ctx, attest.Evidence{Claims: tc.claims, Expect: tc.expect})
			if tc.code == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			fe, ok := fault.As(err)
			if !ok || fe.Code != tc.code || fe.Field != tc.field {
				t.Fatalf("got %v, want %s on %s", err, tc.code, tc.field)
			}
		})
	}
}
