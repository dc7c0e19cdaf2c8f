// Package bus connects a process to NATS, which carries pokes and events.
//
// The bus is only an optimisation: every loop converges from the database
// without it. So a connection here never gives up (MaxReconnects(-1)), starts
// even when no server is up yet (it keeps trying in the background), notices a
// dead server within about ten seconds (PING every 4 s, 2 outstanding), and does
// not buffer publishes silently while disconnected: a publish then fails at
// once and the caller falls back to the database.
package bus

import (
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// Connection tuning; see the package comment.
const (
	PingInterval    = 4 * time.Second
	MaxPingsOut     = 2
	ReconnectWait   = 500 * time.Millisecond
	ReconnectJitter = 500 * time.Millisecond
)

// Connect dials url (one or more comma-separated server URLs) as client name.
// It returns at once even when no server answers yet; check Conn.IsConnected.
func Connect(url, name string, logger *slog.Logger) (*nats.Conn, error) {
	return nats.Connect(url,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(ReconnectWait),
		nats.ReconnectJitter(ReconnectJitter, ReconnectJitter),
		nats.PingInterval(PingInterval),
		nats.MaxPingsOutstanding(MaxPingsOut),
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(c *nats.Conn, err error) {
			if !c.IsClosed() {
				logger.Warn("nats disconnected; falling back to database polling", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			logger.Info("nats reconnected", "server", c.ConnectedUrlRedacted())
		}),
		nats.ConnectHandler(func(c *nats.Conn) {
			logger.Info("nats connected", "server", c.ConnectedUrlRedacted())
		}),
	)
}
