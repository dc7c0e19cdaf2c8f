package nodespec_test

import (
	"errors"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/nodespec"
)

func list(v ...string) *agentv1.StringList { return &agentv1.StringList{Values: v} }

func TestMerge(t *testing.T) {
	t.Parallel()

	t.Run("later sections replace earlier ones whole, in registration order", func(t *testing.T) {
		got, err := nodespec.Merge([]nodespec.Part{
			{Module: "a", Spec: &agentv1.NodeSpec{
				Health: &agentv1.HealthSettings{DiagnosticsLevel: "long", MaxGpuTemperatureCelsius: 90},
				Agent:  &agentv1.AgentSettings{Channel: "beta"},
			}},
			{Module: "b", Spec: nil},
			{Module: "c", Spec: &agentv1.NodeSpec{Health: &agentv1.HealthSettings{CheckInterval: durationpb.New(30e9)}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		want := &agentv1.NodeSpec{
			Health: &agentv1.HealthSettings{CheckInterval: durationpb.New(30e9)},
			Agent:  &agentv1.AgentSettings{Channel: "beta"},
		}
		if !proto.Equal(got, want) {
			t.Fatalf("got %v, want %v", got, want)
		}
	})

	t.Run("site merges field by field", func(t *testing.T) {
		got, err := nodespec.Merge([]nodespec.Part{
			{Module: "system", Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{Gateways: list("gw:8443"), LogLevel: proto.String("info")}}},
			{Module: "site", Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{NtpServers: list("ntp1"), DnsServers: list()}}},
			// The same value again is no conflict.
			{Module: "metal", Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: proto.String("info"), HttpProxy: proto.String("")}}},
		})
		if err != nil {
			t.Fatal(err)
		}
		want := &agentv1.SiteSettings{Gateways: list("gw:8443"), NtpServers: list("ntp1"), DnsServers: list(),
			LogLevel: proto.String("info"), HttpProxy: proto.String("")}
		if !proto.Equal(got.GetSite(), want) {
			t.Fatalf("site %v, want %v", got.GetSite(), want)
		}
		if got.Site.DnsServers == nil || got.Site.HttpProxy == nil {
			t.Fatal("fields set to empty must stay set")
		}
	})

	t.Run("two modules setting a site field differently conflict", func(t *testing.T) {
		for _, tc := range []struct {
			a, b  *agentv1.SiteSettings
			field string
		}{
			{&agentv1.SiteSettings{NtpServers: list("ntp1")}, &agentv1.SiteSettings{NtpServers: list("ntp2")}, "site.ntp_servers"},
			{&agentv1.SiteSettings{NtpServers: list("ntp1")}, &agentv1.SiteSettings{NtpServers: list()}, "site.ntp_servers"},
			{&agentv1.SiteSettings{OtlpEndpoint: proto.String("a:4317")}, &agentv1.SiteSettings{OtlpEndpoint: proto.String("")}, "site.otlp_endpoint"},
		} {
			_, err := nodespec.Merge([]nodespec.Part{
				{Module: "pool", Spec: &agentv1.NodeSpec{Site: tc.a}},
				{Module: "ok", Spec: &agentv1.NodeSpec{Site: &agentv1.SiteSettings{LogLevel: proto.String("debug")}}},
				{Module: "metal", Spec: &agentv1.NodeSpec{Site: tc.b}},
			})
			var ce *nodespec.ConflictError
			if !errors.As(err, &ce) || ce.Field != tc.field || ce.First != "pool" || ce.Second != "metal" {
				t.Fatalf("%v: got %v, want a conflict on %s between pool and metal", tc.b, err, tc.field)
			}
		}
	})
}

func TestCanonical(t *testing.T) {
	t.Parallel()
	spec := func(labels map[string]string) *agentv1.NodeSpec {
		return &agentv1.NodeSpec{
			Identity:  &agentv1.NodeIdentity{NodeId: "node_1", Labels: labels},
			Site:      &agentv1.SiteSettings{LogLevel: proto.String(""), NtpServers: list("b", "a")},
			Instances: &agentv1.Instances{Instances: []*agentv1.Instance{{Id: "vps_1", MemoryBytes: 1 << 40}}},
		}
	}
	a, err := nodespec.Canonical(spec(map[string]string{"z": "1", "a": "2", "m": "3"}))
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"identity":{"labels":{"a":"2","m":"3","z":"1"},"nodeId":"node_1"},"instances":{"instances":[{"id":"vps_1","memoryBytes":"1099511627776"}]},"site":{"logLevel":"","ntpServers":{"values":["b","a"]}}}`
	if string(a) != want {
		t.Fatalf("canonical\n%s, want\n%s", a, want)
	}
	for range 20 {
		b, _ := nodespec.Canonical(spec(map[string]string{"m": "3", "a": "2", "z": "1"}))
		if string(b) != want {
			t.Fatalf("unstable: %s", b)
		}
	}
	// The stored form (jsonb: keys reordered, spaces added) canonicalizes
	// back to the same bytes.
	stored := `{"site": {"ntpServers": {"values": ["b", "a"]}, "logLevel": ""}, "identity": {"nodeId": "node_1", "labels": {"m": "3", "a": "2", "z": "1"}}, "instances": {"instances": [{"memoryBytes": "1099511627776", "id": "vps_1"}]}}`
	if c, err := nodespec.CanonicalJSON([]byte(stored)); err != nil || string(c) != want {
		t.Fatalf("stored form: %s %v", c, err)
	}
}
