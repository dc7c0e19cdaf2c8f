package metal

import (
	"context"
	"fmt"
	"strings"
	"time"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"

	"github.com/bettercompute/bettercompute/pkg/commands"
	"github.com/bettercompute/bettercompute/pkg/jointoken"
	"github.com/bettercompute/bettercompute/pkg/machines"
	"github.com/bettercompute/bettercompute/pkg/nodes"
	"github.com/bettercompute/bettercompute/pkg/sitetasks"
)

// UserData is the cloud-init user data written for the installed system:
// the deploy's own (when set) followed by the join token, on a line of its
// own that the simulated and real installed systems read.
func UserData(own, token string) []byte {
	var b strings.Builder
	if own == "" {
		b.WriteString("#cloud-config\n")
	} else {
		b.WriteString(own)
		if !strings.HasSuffix(own, "\n") {
			b.WriteString("\n")
		}
	}
	b.WriteString(UserDataTokenPrefix + token + "\n")
	return []byte(b.String())
}

// UserDataTokenPrefix starts the user data line holding the join token.
const UserDataTokenPrefix = "# bc.join_token: "

// JoinTokenOf returns the join token of user data written by [UserData].
func JoinTokenOf(userData []byte) string {
	for line := range strings.SplitSeq(string(userData), "\n") {
		if tok, ok := strings.CutPrefix(line, UserDataTokenPrefix); ok {
			return strings.TrimSpace(tok)
		}
	}
	return ""
}

func (p *pass) deploy(ctx context.Context, _ time.Time) (string, error) {
	if p.m.Image == nil {
		return "the deploy names no image", nil
	}
	disks, failure, err := p.disksOr(ctx, "diag.nvml reported no disk to deploy to")
	if err != nil || len(disks) == 0 {
		return failure, err
	}
	img := p.m.Image
	c, err := p.command(ctx, commands.KindImageDeploy, "deploy", func() (any, error) {
		tok, err := p.token(ctx, jointoken.RoleNode, NodeTokenTTL, machines.BootRamdisk)
		if err != nil {
			return nil, err
		}
		return &agentv1.ImageDeploy{Url: img.URL, Sha256: img.SHA256, Disk: disks[0].GetPath(), SizeBytes: uint64(max(img.SizeBytes, 0)),
			Format: agentv1.ImageFormat_IMAGE_FORMAT_RAW, CloudInitUserData: UserData(p.m.CloudInit, tok)}, nil
	})
	if err != nil {
		return "", err
	}
	res, failure, err := p.verdict(ctx, c)
	if err != nil || failure != "" || res == nil {
		return failure, err
	}
	if got := res.GetImageDeploy().GetSha256(); got != img.SHA256 {
		return fmt.Sprintf("image.deploy (%s) wrote sha256 %.64s, want %s", c.ID, got, img.SHA256), nil
	}
	return "", p.move(ctx, machines.StateRebooting, machines.Change{Boot: machines.BootLocal},
		fmt.Sprintf("image %s written to %s (%s)", img.SHA256[:12], disks[0].GetPath(), c.ID))
}

func (p *pass) reboot(ctx context.Context, ts []sitetasks.Task, start time.Time) (string, error) {
	done, failure, err := p.sequence(ctx, ts, []seqStep{
		{sitetasks.KindPXEArm, func(ctx context.Context) (string, error) {
			return "", p.enqueueTask(ctx, sitetasks.KindPXEArm, sitetasks.Payload{MACs: p.m.MACs, Decision: "local"}, nil, p.notAfter())
		}},
		{sitetasks.KindBMCBoot, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCBoot, sitetasks.Payload{BootTarget: "disk"}, p.notAfter())
		}},
		{sitetasks.KindBMCPower, func(ctx context.Context) (string, error) {
			return p.bmcTask(ctx, sitetasks.KindBMCPower, sitetasks.Payload{PowerAction: p.powerAction(ts)}, p.notAfter())
		}},
	})
	if err != nil || failure != "" || !done {
		return failure, err
	}
	ok, failure, err := p.sessionSince(ctx, start, nodes.StateAdopting, nodes.StateAdopted)
	if err != nil || failure != "" || !ok {
		return failure, err
	}
	return "", p.move(ctx, machines.StateJoined, machines.Change{}, "the installed system joined as node "+p.m.NodeID)
}
