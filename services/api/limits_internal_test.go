package api

import (
	"strings"
	"testing"

	computev1 "github.com/bettercompute/bettercompute/proto/bettercompute/compute/v1"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// TestMultiLineTextFieldsAllowLineBreaksOnly: the fields of textFields
// (a policy's body, user data, cloud-init, a BMC's CA in PEM) take tab,
// newline and carriage return, and their own maximum; no other control
// character, in them or anywhere else.
func TestMultiLineTextFieldsAllowLineBreaksOnly(t *testing.T) {
	t.Parallel()
	pem := "-----BEGIN CERTIFICATE-----\r\n" + strings.Repeat(strings.Repeat("A", 64)+"\n", 30) + "-----END CERTIFICATE-----\n"
	enroll := func(ca string) *computev1.MetalServiceEnrollRequest {
		return &computev1.MetalServiceEnrollRequest{TenantId: "root", Bmc: &computev1.MachineBMC{Address: "10.0.0.5", CaPem: ca}}
	}
	if err := checkLimits(enroll(pem)); err != nil {
		t.Fatalf("a %d-byte PEM: %v", len(pem), err)
	}
	for _, bad := range []string{pem + "\x1b[2J", pem + "\x00"} {
		if err := checkLimits(enroll(bad)); fault.CodeOf(err) != fault.InvalidInput || !strings.Contains(err.Error(), "bmc.caPem") {
			t.Errorf("%v", err)
		}
	}
	if err := checkLimits(&computev1.MetalServiceEnrollRequest{TenantId: "root", Name: "a\nb"}); err == nil {
		t.Error("a newline in a name was accepted")
	}
	for name := range textFields {
		if _, ok := maxStringByField[name]; !ok {
			t.Errorf("multi-line field %s has no maximum of its own", name)
		}
	}
}
