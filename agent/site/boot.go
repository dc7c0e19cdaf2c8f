package site

import (
	"context"
	"sync"

	"github.com/bettercompute/bettercompute/agent/site/pxe"
)

// PXEBoot is the BootServer that runs the real PXE services (pxe.Server)
// while the agent holds the boot lease: Serve starts a fresh pxe.Server on
// cfg (a stopped one does not restart), Stop stops it. cfg.Machines is
// typically the *pxe.Table also given as Config.PXE, so armed machines stay
// armed across a lost and regained lease.
type PXEBoot struct {
	cfg pxe.Config

	mu  sync.Mutex
	srv *pxe.Server
}

// NewPXEBoot checks cfg (as pxe.New does) and returns the boot server.
func NewPXEBoot(cfg pxe.Config) (*PXEBoot, error) {
	if _, err := pxe.New(cfg); err != nil {
		return nil, err
	}
	return &PXEBoot{cfg: cfg}, nil
}

// Serve implements BootServer.
func (b *PXEBoot) Serve(epoch int64) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv != nil {
		b.srv.Stop()
		b.srv = nil
	}
	cfg := b.cfg
	if cfg.Logger != nil {
		cfg.Logger = cfg.Logger.With("epoch", epoch)
	}
	srv, err := pxe.New(cfg)
	if err != nil {
		return err
	}
	if err := srv.Start(context.Background()); err != nil {
		return err
	}
	b.srv = srv
	return nil
}

// Stop implements BootServer.
func (b *PXEBoot) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv != nil {
		b.srv.Stop()
		b.srv = nil
	}
}

// Addrs returns where the running server listens; zero when stopped.
func (b *PXEBoot) Addrs() pxe.Addrs {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.srv == nil {
		return pxe.Addrs{}
	}
	return b.srv.Addrs()
}
