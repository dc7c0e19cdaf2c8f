package ramdisk

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"regexp"

	agentv1 "github.com/bettercompute/bettercompute/proto/bettercompute/agent/v1"
	"github.com/bettercompute/bettercompute/proto/commandkinds"
)

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

func checkURL(field, raw string) error {
	if raw == "" || len(raw) > commandkinds.MaxURL {
		return fieldErr(field, "required: an http:// or https:// URL of at most %d characters", commandkinds.MaxURL)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fieldErr(field, "want an http:// or https:// URL")
	}
	return nil
}

func checkSHA256(field, s string) error {
	if !sha256Hex.MatchString(s) {
		return fieldErr(field, "want a SHA-256: 64 lower-case hex characters")
	}
	return nil
}

// scrubBytes is how much of a disk a failed deploy zeroes again: enough to
// clear a partition table, so the machine does not boot a partial or
// unverified image.
const scrubBytes = chunk

// DeployImage runs image.deploy: it streams the image from the URL onto the
// disk from offset 0 through a fixed buffer while hashing it, syncs, and
// succeeds only when the SHA-256 (and size_bytes, when set) match. An image
// larger than the disk, a cut download or a mismatch fails, says so, and
// zeroes the disk's first MiB again; the result returned with a mismatch
// says what was written.
func (r *Ramdisk) DeployImage(ctx context.Context, p *agentv1.ImageDeploy) (*agentv1.ImageDeployResult, error) {
	if err := checkURL("payload.url", p.GetUrl()); err != nil {
		return nil, err
	}
	if err := checkSHA256("payload.sha256", p.GetSha256()); err != nil {
		return nil, err
	}
	switch p.GetFormat() {
	case agentv1.ImageFormat_IMAGE_FORMAT_UNSPECIFIED, agentv1.ImageFormat_IMAGE_FORMAT_RAW:
	default:
		return nil, fieldErr("payload.format", "only IMAGE_FORMAT_RAW is supported, got %s", p.GetFormat())
	}
	if len(p.GetCloudInitUserData()) > MaxCloudInitUserData {
		return nil, fieldErr("payload.cloudInitUserData", "at most %d bytes, got %d", MaxCloudInitUserData, len(p.GetCloudInitUserData()))
	}
	path, err := r.disk("payload.disk", p.GetDisk())
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, err
	}
	if p.GetSizeBytes() > uint64(size) {
		return nil, fieldErr("payload.sizeBytes", "an image of %d bytes does not fit disk %s of %d bytes", p.GetSizeBytes(), p.GetDisk(), size)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.GetUrl(), nil)
	if err != nil {
		return nil, fieldErr("payload.url", "%v", err)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch the image: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("fetch the image: %s", resp.Status)
	}
	switch cl := resp.ContentLength; {
	case cl > size:
		return nil, fmt.Errorf("the image is %d bytes, disk %s only %d", cl, p.GetDisk(), size)
	case cl >= 0 && p.GetSizeBytes() > 0 && uint64(cl) != p.GetSizeBytes():
		return nil, fmt.Errorf("the server sends %d bytes, size_bytes says %d", cl, p.GetSizeBytes())
	}
	r.log.Info("deploying image", "disk", p.GetDisk(), "url", p.GetUrl(), "bytes", resp.ContentLength)
	h := sha256.New()
	n, err := io.CopyBuffer(io.MultiWriter(io.NewOffsetWriter(f, 0), h), io.LimitReader(resp.Body, size), make([]byte, chunk))
	var more bool
	if err == nil && n == size {
		// Anything past the disk's end: the image is too large (and
		// nothing is written beyond the end).
		var b [1]byte
		k, rerr := io.ReadFull(resp.Body, b[:])
		more = k > 0
		if rerr != nil && !errors.Is(rerr, io.EOF) && !errors.Is(rerr, io.ErrUnexpectedEOF) {
			err = rerr
		}
	}
	res := &agentv1.ImageDeployResult{Disk: p.GetDisk(), Sha256: hex.EncodeToString(h.Sum(nil)), Bytes: uint64(n)}
	fail := func(err error) (*agentv1.ImageDeployResult, error) {
		if serr := scrub(f, min(n, size, scrubBytes)); serr != nil {
			err = errors.Join(err, fmt.Errorf("zeroing the partial image: %w", serr))
		}
		return res, err
	}
	switch {
	case err != nil && ctx.Err() != nil:
		return fail(context.Cause(ctx))
	case err != nil:
		return fail(fmt.Errorf("the download was cut after %d bytes: %w", n, err))
	case more:
		return fail(fmt.Errorf("the image is larger than disk %s (%d bytes)", p.GetDisk(), size))
	case p.GetSizeBytes() > 0 && uint64(n) != p.GetSizeBytes():
		return fail(fmt.Errorf("got %d bytes, size_bytes says %d", n, p.GetSizeBytes()))
	case res.Sha256 != p.GetSha256():
		return fail(fmt.Errorf("sha256 mismatch: the %d bytes written hash to %s, the command wants %s", n, res.Sha256, p.GetSha256()))
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("sync %s: %w", p.GetDisk(), err))
	}
	if ud := p.GetCloudInitUserData(); len(ud) > 0 {
		// The NoCloud seed of the installed system, beside the disk.
		if err := os.WriteFile(path+UserDataSuffix, ud, 0o600); err != nil {
			return fail(fmt.Errorf("write the cloud-init seed of %s: %w", p.GetDisk(), err))
		}
	}
	return res, nil
}

// MaxCloudInitUserData bounds image.deploy's cloud-init user data.
const MaxCloudInitUserData = 64 << 10

// UserDataSuffix names the cloud-init seed image.deploy writes beside the
// disk: <disk>.user-data (a NoCloud seed; in simulation, where disks are
// files, the installed system reads it there).
const UserDataSuffix = ".user-data"

// scrub zeroes the first n bytes of f and syncs.
func scrub(f *os.File, n int64) error {
	if _, err := f.WriteAt(zeros[:n], 0); err != nil {
		return err
	}
	return f.Sync()
}

// fetch streams url into a new file dst through a fixed buffer, at most
// limit bytes, and removes it unless its SHA-256 is want.
func (r *Ramdisk) fetch(ctx context.Context, field, rawURL, want, dst string, limit int64) (err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return fieldErr(field, "%v", err)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return fmt.Errorf("fetch %s: %w", rawURL, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetch %s: %s", rawURL, resp.Status)
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()
	h := sha256.New()
	n, err := io.CopyBuffer(io.MultiWriter(f, h), io.LimitReader(resp.Body, limit+1), make([]byte, 64<<10))
	switch {
	case err != nil:
		return fmt.Errorf("fetch %s: cut after %d bytes: %w", rawURL, n, err)
	case n > limit:
		return fmt.Errorf("fetch %s: more than %d bytes", rawURL, limit)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != want {
		return fmt.Errorf("%s: sha256 mismatch: %s hashes to %s, the command wants %s", field, rawURL, got, want)
	}
	return f.Sync()
}
