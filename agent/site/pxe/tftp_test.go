package pxe

import (
	"bytes"
	"strings"
	"testing"

	"github.com/pin/tftp/v3"
)

func tftpClient(t *testing.T, h *harness) *tftp.Client {
	t.Helper()
	c, err := tftp.NewClient(h.srv.Addrs().TFTP.String())
	if err != nil {
		t.Fatal(err)
	}
	c.RequestTSize(true)
	return c
}

func tftpGet(c *tftp.Client, name string) ([]byte, int64, error) {
	wt, err := c.Receive(name, "octet")
	if err != nil {
		return nil, 0, err
	}
	var size int64 = -1
	if it, ok := wt.(tftp.IncomingTransfer); ok {
		size, _ = it.Size()
	}
	var buf bytes.Buffer
	if _, err := wt.WriteTo(&buf); err != nil {
		return nil, 0, err
	}
	return buf.Bytes(), size, nil
}

func TestTFTP(t *testing.T) {
	t.Parallel()
	h := setup(t)
	c := tftpClient(t, h)

	t.Run("serves the iPXE binaries", func(t *testing.T) {
		for name, want := range map[string][]byte{"undionly.kpxe": fakeBIOS, "/ipxe.efi": fakeUEFI} {
			got, size, err := tftpGet(c, name)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("%s: got %d bytes, want %d", name, len(got), len(want))
			}
			if size != int64(len(want)) {
				t.Errorf("%s: tsize = %d, want %d", name, size, len(want))
			}
		}
	})
	t.Run("refuses traversal and files it does not serve", func(t *testing.T) {
		for _, name := range []string{"../undionly.kpxe", "/etc/passwd", "ipxe.efi/../other.bin", "other.bin",
			"..%2fipxe.efi", "./ipxe.efi", "sub/ipxe.efi", strings.Repeat("a", 300)} {
			if got, _, err := tftpGet(c, name); err == nil {
				t.Errorf("%q: served %d bytes", name, len(got))
			}
		}
	})
	t.Run("refuses writes", func(t *testing.T) {
		rf, err := c.Send("undionly.kpxe", "octet")
		if err == nil {
			_, err = rf.ReadFrom(strings.NewReader("overwritten"))
		}
		if err == nil {
			t.Fatal("write accepted")
		}
		got, _, err := tftpGet(c, "undionly.kpxe")
		if err != nil || !bytes.Equal(got, fakeBIOS) {
			t.Fatalf("file changed after a refused write: %v", err)
		}
	})
}
