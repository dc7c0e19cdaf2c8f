// Package config is Better Compute's one configuration: every process mode
// (`serve --roles …`, `dev`, `migrate`, each deployable's own main) reads the
// same struct from a YAML file, environment overrides and flags, in that order
// of precedence, and validates it before anything touches the database.
//
// A bad configuration fails with INVALID_CONFIG and names the field (as its
// YAML path, e.g. "server.port") and what was expected.
//
// Environment overrides: every field can be set with BC_ and its YAML path in
// upper snake case (server.shutdownTimeout → BC_SERVER_SHUTDOWN_TIMEOUT). The
// conventional DATABASE_URL, NATS_URL and OTEL_EXPORTER_OTLP_ENDPOINT are
// honoured too; the BC_ name wins when both are set.
package config

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/pkg/fault"
	"github.com/bettercompute/bettercompute/proto/agentrelease"
)

// Config is the whole configuration. The zero value of each field means "use
// the default", which [Config.Defaults] fills in.
type Config struct {
	// Roles this process hosts; empty means [RoleAll].
	Roles []string `yaml:"roles"`
	// Database is the PostgreSQL connection.
	Database Database `yaml:"database"`
	// NATS is the message bus for pokes and events. Optional: every loop
	// converges from the database without it.
	NATS NATS `yaml:"nats"`
	// Server is the process's listener and lifecycle.
	Server Server `yaml:"server"`
	// Log is the process log.
	Log Log `yaml:"log"`
	// Telemetry is tracing export.
	Telemetry Telemetry `yaml:"telemetry"`
	// Runtime tunes the reconciler runtime of the controllers and scheduler
	// roles.
	Runtime Runtime `yaml:"runtime"`
	// JoinService is the node CA and join-token redemption: the joinservice
	// role, standalone on its internal listener or inside a gateway that
	// does not relay (gateway.joinService unset).
	JoinService JoinService `yaml:"joinService"`
	// Host says what an `all` process hosts beyond the API and the worker
	// roles.
	Host Host `yaml:"host"`
	// Gateway configures the gateway role.
	Gateway Gateway `yaml:"gateway"`
	// Commands configures the command queue: the signing key of destructive
	// commands (gateway) and the command-sweeper.
	Commands Commands `yaml:"commands"`
	// Dev configures `better-compute dev` only.
	Dev Dev `yaml:"dev"`
	// Capacity configures GPU reservations (the scheduler role's placer).
	Capacity Capacity `yaml:"capacity"`
	// Nodes configures node liveness and the brakes on acting on lost
	// nodes.
	Nodes Nodes `yaml:"nodes"`
	// Health configures the health job's remediation ladder and its
	// brakes.
	Health Health `yaml:"health"`
	// Fleet configures fleet.drift: the nodes' Drifted condition.
	Fleet Fleet `yaml:"fleet"`
	// IAM configures the iam role's jobs: API keys pruned and warned of
	// before they expire, the authorization projection re-verified.
	IAM IAM `yaml:"iam"`
	// Events configures the outbox relay, the event stream and retention.
	Events Events `yaml:"events"`
	// Webhooks configures webhook delivery.
	Webhooks Webhooks `yaml:"webhooks"`
	// Providers configures the requests to provider pools' APIs.
	Providers Providers `yaml:"providers"`
	// Audit configures the audit hash chain and its signed checkpoints.
	Audit Audit `yaml:"audit"`
	// Tunnels bounds port forwards.
	Tunnels Tunnels `yaml:"tunnels"`
	// Secrets configures the key that seals secrets (BMC credentials) at
	// rest.
	Secrets Secrets `yaml:"secrets"`
	// Metal configures the metal role's bare-metal workflow.
	Metal Metal `yaml:"metal"`
	// MCP configures the api role's MCP server.
	MCP MCP `yaml:"mcp"`
	// Console configures the api role's web console's sessions.
	Console Console `yaml:"console"`
	// Artifacts is the directory of bcd builds and their signed release
	// manifests the api role serves (`better-compute artifacts publish`).
	Artifacts Artifacts `yaml:"artifacts"`
}

// Artifacts configures the api role's static store of bcd builds.
type Artifacts struct {
	// Dir is the directory `better-compute artifacts publish` writes and the
	// api role serves read-only at /artifacts/ (flat names only, no
	// listing, no authentication: a build's integrity is its signed
	// manifest's). Empty: not served.
	Dir string `yaml:"dir"`
}

// JoinService configures the node CA and joinservice's HPKE key. Keys come
// from files, or, for development, are generated once into KeyDir.
type JoinService struct {
	// TrustDomain is the SPIFFE trust domain of node and gateway
	// certificates (spiffe://<trustDomain>/node/<id>); default
	// bettercompute.local.
	TrustDomain string `yaml:"trustDomain"`
	// CACertFile and CAKeyFile are the node CA's certificate (PEM, optionally
	// followed by its chain to a root) and private key (PEM). Set both, or
	// neither and KeyDir.
	CACertFile string `yaml:"caCertFile"`
	CAKeyFile  string `yaml:"caKeyFile"`
	// HPKEKeyFile is joinservice's X25519 private key (PEM PKCS#8), to which
	// daemons seal join tokens. Unset uses KeyDir.
	HPKEKeyFile string `yaml:"hpkeKeyFile"`
	// KeyDir, for development, is where a CA and an HPKE key are generated
	// once and reused when the files above are unset; dev sets
	// <dev.dataDir>/pki.
	KeyDir string `yaml:"keyDir"`
	// Listen is the internal listener of the joinservice role (host:port):
	// Join and Renew relayed by gateways, over mutual TLS, where a caller
	// must present a gateway certificate of the trust domain. Empty means
	// ":8444" when the joinservice role is asked for by name, and that
	// `all` hosts joinservice inside its gateway with no listener.
	Listen string `yaml:"listen"`
	// Hosts are the DNS names and IPs gateways dial joinservice at, put in
	// the certificate the node CA signs for the internal listener at start
	// (URI SAN spiffe://<trustDomain>/joinservice); default the host name,
	// localhost and 127.0.0.1.
	Hosts []string `yaml:"hosts"`
	// TLS replaces that certificate with files of the operator's.
	TLS CertKey `yaml:"tls"`
}

// CertKey is a certificate (PEM, leaf first, with its chain) and its
// private key (PEM).
type CertKey struct {
	CertFile string `yaml:"certFile"`
	KeyFile  string `yaml:"keyFile"`
}

// GatewayTLS is the gateway's own certificate, for a gateway that holds no
// node CA: it serves daemons with it and presents it to joinservice.
type GatewayTLS struct {
	// CertFile and KeyFile are the gateway's certificate (PEM, URI SAN
	// spiffe://<trustDomain>/gateway/<id>, server and client
	// authentication, signed by the node CA) and its key.
	CertFile string `yaml:"certFile"`
	KeyFile  string `yaml:"keyFile"`
	// CAFile is the trust bundle (PEM certificates of the node CA): node
	// certificates and joinservice's must chain to it.
	CAFile string `yaml:"caFile"`
}

// Host is what an `all` process hosts beyond the API and every worker
// role (the spec's process modes).
type Host struct {
	// Gateway, when set, is the address (host:port) of the gateway an
	// `all` process also runs; unset, `all` runs none. It is the
	// gateway's listener (gateway.listen, when that is unset). Under
	// `all`, gateway.listen alone still starts one, with a warning, for
	// one release.
	Gateway string `yaml:"gateway"`
}

// Gateway configures the gateway role: node daemons' sessions over mutual
// TLS, on a listener of its own.
type Gateway struct {
	// Listen is the daemons' host:port. Empty means ":8443" when the gateway
	// role is asked for by name, and that `all` runs no gateway (dev sets
	// 127.0.0.1:8443).
	Listen string `yaml:"listen"`
	// ID names the gateway in nodes.gateway_id and its SPIFFE ID; default
	// the host name.
	ID string `yaml:"id"`
	// Hosts are the DNS names and IPs daemons dial, put in the serving
	// certificate; default the host name, localhost and 127.0.0.1.
	Hosts []string `yaml:"hosts"`
	// Advertise is the host:port API processes in other processes reach
	// this gateway at to relay tunnels (GatewayService, internal mutual
	// TLS; docs/tunnels.md); empty means the listener's address, with the
	// host name in place of an unspecified host.
	Advertise string `yaml:"advertise"`
	// HeartbeatInterval is what daemons are asked to heartbeat at; default
	// 10s.
	HeartbeatInterval Duration `yaml:"heartbeatInterval"`
	// LivenessInterval is how often liveness is written, one statement for
	// all sessions; default 5s.
	LivenessInterval Duration `yaml:"livenessInterval"`
	// AdmitRate is how many sessions a second the gateway opens (each
	// costs a revocation check and a transaction); default 1000. A
	// reconnect storm queues behind it instead of on the database.
	AdmitRate float64 `yaml:"admitRate"`
	// AdmitBurst is how many sessions may open at once above the rate;
	// default 200.
	AdmitBurst int `yaml:"admitBurst"`
	// AdmitWait is the longest a session waits for admission; one that
	// would wait longer is refused RESOURCE_EXHAUSTED with a jittered
	// retry delay, which the daemon honours. Default 10s.
	AdmitWait Duration `yaml:"admitWait"`
	// JoinService are joinservice's internal addresses (host:port, at most
	// 16). Set, the gateway relays Join and Renew to them over mutual TLS
	// (round robin, ready connections first, the next address when one is
	// unreachable) and loads no node CA key, HPKE key or signing key; it
	// then needs gateway.tls. Empty, joinservice runs inside the gateway's
	// process (`all`, dev).
	JoinService []string `yaml:"joinService"`
	// JoinServiceTimeout bounds one relayed call to one address; default
	// 10s.
	JoinServiceTimeout Duration `yaml:"joinServiceTimeout"`
	// TLS is the gateway's own certificate and the trust bundle; required
	// with JoinService. Unset, the in-process node CA signs a serving
	// certificate for Hosts at start.
	TLS GatewayTLS `yaml:"tls"`
	// AgentVersions is the version-skew window: sessions of node daemons
	// older than Oldest are refused AGENT_TOO_OLD, newer than Newest
	// AGENT_TOO_NEW. Unset, every version is accepted.
	AgentVersions AgentVersions `yaml:"agentVersions"`
}

// AgentVersions is the gateway's version-skew window, semantic versions
// ("v0.3.1"); either end may be unset (open).
type AgentVersions struct {
	// Oldest is the oldest bcd version accepted.
	Oldest string `yaml:"oldest"`
	// Newest is the newest bcd version accepted.
	Newest string `yaml:"newest"`
}

// Commands configures the command queue.
type Commands struct {
	// SigningKeyFile is the Ed25519 private key (PEM PKCS#8) the api and
	// controllers roles sign destructive commands (node.reboot) with when
	// they queue them (gateways never read it); daemons pin its public
	// key. Unset means destructive commands go unsigned and daemons reject
	// them BAD_SIGNATURE; dev generates <dev.dataDir>/pki/command-signing.key.
	SigningKeyFile string `yaml:"signingKeyFile"`
	// SweepInterval is how often the command-sweeper expires and times out
	// commands; default 5s.
	SweepInterval Duration `yaml:"sweepInterval"`
}

// Database is the PostgreSQL connection.
type Database struct {
	// URL is a postgres:// URL or a libpq key=value DSN. Required by every
	// mode except dev, which resolves one itself when it is empty.
	URL string `yaml:"url" env:"DATABASE_URL"`
	// MaxConns caps the pool; 0 means pgx's default (max(4, CPUs)).
	MaxConns int `yaml:"maxConns"`
	// PgBouncer says the URL goes through PgBouncer in transaction mode: no
	// named prepared statements, and migrations lock with a table row instead
	// of a session advisory lock.
	PgBouncer bool `yaml:"pgbouncer"`
	// IdleInTransactionTimeout is the server's
	// idle_in_transaction_session_timeout for every connection: a process
	// paused or stuck inside a transaction (SIGSTOP, a hung client) has
	// its session ended and its locks released after this long, instead
	// of blocking every other process's writes to those rows. Default 5m.
	// Not sent through PgBouncer (it refuses startup parameters): set
	// PgBouncer's idle_transaction_timeout, or the role's setting, there.
	IdleInTransactionTimeout Duration `yaml:"idleInTransactionTimeout"`
}

// NATS is the message bus.
type NATS struct {
	// URL is one or more comma-separated nats:// (or tls://) server URLs.
	// Empty runs without the bus (polling only); dev embeds a server.
	URL string `yaml:"url" env:"NATS_URL"`
}

// Server is the process's listener and lifecycle.
type Server struct {
	// Host to listen on; default 0.0.0.0 (dev: 127.0.0.1).
	Host string `yaml:"host"`
	// Port serves gRPC, REST, /healthz and /readyz (HTTP/1.1 and h2c on one
	// port; /metrics is on AdminAddr). Default 8080; 0 in a test means any
	// free port.
	Port *int `yaml:"port"`
	// ShutdownTimeout bounds a graceful stop on SIGINT/SIGTERM; default 15s.
	ShutdownTimeout Duration `yaml:"shutdownTimeout"`
	// NoMigrate stops serve from applying migrations at start; it then only
	// checks the schema and refuses to run behind it.
	NoMigrate bool `yaml:"noMigrate"`
	// TrustedProxies are the proxies (CIDRs or addresses) in front of the
	// API port, such as an ingress or a load balancer: when a request's peer
	// is one of them, its client address is the right-most X-Forwarded-For
	// entry that is not; from any other peer X-Forwarded-For is ignored.
	// The per-address limits (failed authentications, anonymous requests)
	// key on that address. Empty (the default) trusts none.
	TrustedProxies []string `yaml:"trustedProxies"`
	// ReadTimeout bounds reading a whole request, body included; default
	// 60s. IdleTimeout closes a keep-alive connection idle that long;
	// default 120s. (Headers must arrive within 10 s.)
	ReadTimeout Duration `yaml:"readTimeout"`
	IdleTimeout Duration `yaml:"idleTimeout"`
	// AdminAddr (host:port) serves /metrics, /debug/pprof/ and gRPC
	// reflection, none of which the API port serves: nothing anonymous
	// on the API's listener by default. Unset, it is [DefaultAdminAddr]
	// (loopback; 127.0.0.1:0, any free port, when server.port is 0); the
	// value [AdminOnAPIPort] ("api") serves them on the API port instead,
	// to anyone who reaches it (dev does so on its loopback port). Keep it
	// off the public network. See [Server.Admin].
	AdminAddr string `yaml:"adminAddr"`
	// TLS serves the API port over TLS when CertFile and KeyFile are set.
	TLS ServerTLS `yaml:"tls"`
}

// DefaultAdminAddr is server.adminAddr's default: loopback only.
const DefaultAdminAddr = "127.0.0.1:9090"

// AdminOnAPIPort is the server.adminAddr that serves /metrics, pprof and
// reflection on the API port (anonymously, to whoever reaches it).
const AdminOnAPIPort = "api"

// Admin resolves server.adminAddr: the admin listener's address, or
// onAPI when they are served on the API port ("api"). Unset is
// [DefaultAdminAddr], or 127.0.0.1:0 when server.port is 0 (tests: any
// free port).
func (s Server) Admin() (addr string, onAPI bool) {
	switch {
	case s.AdminAddr == AdminOnAPIPort:
		return "", true
	case s.AdminAddr != "":
		return s.AdminAddr, false
	case s.Port != nil && *s.Port == 0:
		return "127.0.0.1:0", false
	}
	return DefaultAdminAddr, false
}

// ServerTLS is the API listener's TLS.
type ServerTLS struct {
	// CertFile and KeyFile are the serving certificate (PEM, with its
	// chain) and its private key.
	CertFile string `yaml:"certFile"`
	KeyFile  string `yaml:"keyFile"`
	// ClientCAFile, when set, requires every client to present a
	// certificate that chains to these CAs (mutual TLS), on top of the
	// API's own credentials.
	ClientCAFile string `yaml:"clientCAFile"`
}

// Log is the process log.
type Log struct {
	// Level is debug, info (default), warn or error.
	Level string `yaml:"level"`
	// Format is json (default) or text (dev's default).
	Format string `yaml:"format"`
}

// Telemetry is tracing export.
type Telemetry struct {
	// OTLPEndpoint, when set, exports traces over OTLP/gRPC to host:port (or
	// an http(s):// URL). Empty disables tracing export.
	OTLPEndpoint string `yaml:"otlpEndpoint" env:"OTEL_EXPORTER_OTLP_ENDPOINT"`
	// ServiceName is the OpenTelemetry service.name; default better-compute.
	ServiceName string `yaml:"serviceName"`
}

// Runtime tunes the reconciler runtime (see pkg/reconcile).
type Runtime struct {
	// Heartbeat is how often a worker renews its membership and leases and
	// rebalances shards; default 2s.
	Heartbeat Duration `yaml:"heartbeat"`
	// LeaseTTL is how long a lease or worker row lives unrenewed; default 5
	// heartbeats, at least 2.
	LeaseTTL Duration `yaml:"leaseTTL"`
	// ResyncEvery and ResyncJitter: every worker re-enqueues the keys it owns
	// every ResyncEvery plus up to ResyncJitter; defaults 5m and 5m.
	ResyncEvery  Duration `yaml:"resyncEvery"`
	ResyncJitter Duration `yaml:"resyncJitter"`
	// Poll is how often the queue is polled while the bus is up; default 2s.
	// PollBusDown is used while it is down; default 250ms.
	Poll        Duration `yaml:"poll"`
	PollBusDown Duration `yaml:"pollBusDown"`
	// Concurrency bounds runs in flight per process; default 8. Batch bounds
	// one claim; default 256.
	Concurrency int `yaml:"concurrency"`
	Batch       int `yaml:"batch"`
}

// Dev configures `better-compute dev`.
type Dev struct {
	// SimNodes is how many simulated node daemons (the real agent with a
	// mock DGX H200) dev joins to a pool "sim" in the root tenant, so the
	// control plane has a live fleet; default 3, 0 for none.
	SimNodes *int `yaml:"simNodes"`
	// SimMachines is how many simulated bare-metal machines (fake Redfish
	// BMCs) dev enrolls at a simulated site "sim" with an in-process site
	// agent; all but one reach ready and one is deployed and joins as a node.
	// Default 3, or 0 when SimNodes is 0 (no simulation at all); 0 for none.
	SimMachines *int `yaml:"simMachines"`
	// SimInstances makes dev start VPS pools: a hosted pool "vps" of two
	// more simulated nodes running the simulated VPS runtime, and a
	// provider pool "cloud" on a fake provider dev serves on loopback.
	// Default true, or false when SimNodes is 0 (no simulation at all).
	SimInstances *bool `yaml:"simInstances"`
	// DataDir keeps dev's private PostgreSQL cluster, NATS store and first
	// credential; default ./.data.
	DataDir string `yaml:"dataDir"`
}

// MaxSimMachines bounds dev.simMachines (one MAC byte each).
const MaxSimMachines = 64

// Duration is a time.Duration written as "15s", "5m" in YAML and environment.
type Duration time.Duration

// UnmarshalYAML parses a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("expected a duration such as 15s, got %q", n.Value)
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes the duration string.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// Std returns the time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

// DefaultPort is the port serve listens on when none is configured.
const DefaultPort = 8080

// Defaults fills every unset field with its default.
func (c *Config) Defaults() {
	c.Console.defaults()
	c.Tunnels.defaults()
	c.Metal.defaults()
	c.Server.Host = cmp.Or(c.Server.Host, "0.0.0.0")
	if c.Server.Port == nil {
		p := DefaultPort
		c.Server.Port = &p
	}
	c.Server.ShutdownTimeout = cmp.Or(c.Server.ShutdownTimeout, Duration(15*time.Second))
	c.Database.IdleInTransactionTimeout = cmp.Or(c.Database.IdleInTransactionTimeout, Duration(5*time.Minute))
	c.Server.ReadTimeout = cmp.Or(c.Server.ReadTimeout, Duration(time.Minute))
	c.Server.IdleTimeout = cmp.Or(c.Server.IdleTimeout, Duration(2*time.Minute))
	c.Log.Level = cmp.Or(c.Log.Level, "info")
	c.Log.Format = cmp.Or(c.Log.Format, "json")
	c.Telemetry.ServiceName = cmp.Or(c.Telemetry.ServiceName, "better-compute")
	c.Dev.DataDir = cmp.Or(c.Dev.DataDir, ".data")
	if c.Dev.SimNodes == nil {
		n := 3
		c.Dev.SimNodes = &n
	}
	if c.Dev.SimMachines == nil {
		n := 3
		if *c.Dev.SimNodes == 0 {
			n = 0
		}
		c.Dev.SimMachines = &n
	}
	if c.Dev.SimInstances == nil {
		on := *c.Dev.SimNodes > 0
		c.Dev.SimInstances = &on
	}
	c.JoinService.TrustDomain = cmp.Or(c.JoinService.TrustDomain, "bettercompute.local")
	host, _ := os.Hostname()
	host = strings.ToLower(cmp.Or(host, "gateway"))
	c.Gateway.ID = cmp.Or(c.Gateway.ID, host)
	if len(c.Gateway.Hosts) == 0 {
		c.Gateway.Hosts = []string{host, "localhost", "127.0.0.1"}
	}
	c.Gateway.HeartbeatInterval = cmp.Or(c.Gateway.HeartbeatInterval, Duration(10*time.Second))
	c.Gateway.LivenessInterval = cmp.Or(c.Gateway.LivenessInterval, Duration(5*time.Second))
	c.Gateway.AdmitRate = cmp.Or(c.Gateway.AdmitRate, 1000)
	c.Gateway.AdmitBurst = cmp.Or(c.Gateway.AdmitBurst, 200)
	c.Gateway.AdmitWait = cmp.Or(c.Gateway.AdmitWait, Duration(10*time.Second))
	c.Gateway.JoinServiceTimeout = cmp.Or(c.Gateway.JoinServiceTimeout, Duration(10*time.Second))
	if len(c.JoinService.Hosts) == 0 {
		c.JoinService.Hosts = []string{host, "localhost", "127.0.0.1"}
	}
	c.Commands.SweepInterval = cmp.Or(c.Commands.SweepInterval, Duration(5*time.Second))
	r := &c.Runtime
	r.Heartbeat = cmp.Or(r.Heartbeat, Duration(2*time.Second))
	r.LeaseTTL = cmp.Or(r.LeaseTTL, 5*r.Heartbeat)
	r.ResyncEvery = cmp.Or(r.ResyncEvery, Duration(5*time.Minute))
	r.ResyncJitter = cmp.Or(r.ResyncJitter, Duration(5*time.Minute))
	r.Poll = cmp.Or(r.Poll, Duration(2*time.Second))
	r.PollBusDown = cmp.Or(r.PollBusDown, Duration(250*time.Millisecond))
	r.Concurrency = cmp.Or(r.Concurrency, 8)
	r.Batch = cmp.Or(r.Batch, 256)
	c.Nodes.defaults(&c.Capacity)
	c.Health.defaults()
	c.Fleet.defaults()
	c.IAM.defaults()
	c.Capacity.defaults()
	c.Events.defaults()
	c.Webhooks.defaults()
	c.Audit.defaults()
}

// LoadOptions says where [Load] reads from.
type LoadOptions struct {
	// Path of a YAML file; empty reads none. A path that does not exist is an
	// error.
	Path string
	// LookupEnv reads the environment; nil uses os.LookupEnv.
	LookupEnv func(string) (string, bool)
}

// Load reads the file, then applies environment overrides. It does not fill
// defaults or validate: apply flags, then call [Config.Defaults] and
// [Config.Validate].
func Load(opts LoadOptions) (*Config, error) {
	c := &Config{}
	if opts.Path != "" {
		b, err := os.ReadFile(opts.Path)
		if err != nil {
			return nil, fault.Wrap(err, fault.InvalidConfig, "config", "cannot read the configuration file %q: %v", opts.Path, errors.Unwrap(err))
		}
		if err := decodeYAML(b, c); err != nil {
			return nil, err
		}
	}
	lookup := opts.LookupEnv
	if lookup == nil {
		lookup = os.LookupEnv
	}
	if err := applyEnv(c, lookup); err != nil {
		return nil, err
	}
	return c, nil
}

// Validate checks every field and returns all problems joined, each an
// INVALID_CONFIG *fault.Error naming its field. Call it after Defaults.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fault.New(fault.InvalidConfig, field, format, args...))
	}
	if _, err := ParseRoles(c.Roles); err != nil {
		errs = append(errs, err)
	}
	if c.Database.URL != "" {
		if err := checkDatabaseURL(c.Database.URL); err != nil {
			bad("database.url", "%v", err)
		}
	}
	if t := c.Database.IdleInTransactionTimeout.Std(); t < 0 || t > 24*time.Hour {
		bad("database.idleInTransactionTimeout", "expected 0 (the default, 5m) to 24h, got %s", t)
	}
	if c.Database.MaxConns < 0 || c.Database.MaxConns > 10000 {
		bad("database.maxConns", "expected 0 (the default) to 10000, got %d", c.Database.MaxConns)
	}
	if c.NATS.URL != "" {
		for u := range strings.SplitSeq(c.NATS.URL, ",") {
			if err := checkURL(strings.TrimSpace(u), "nats", "tls", "ws", "wss"); err != nil {
				bad("nats.url", "%v", err)
				break
			}
		}
	}
	if c.Server.Host == "" {
		bad("server.host", "expected a host or IP address to listen on, got an empty string")
	}
	if c.Server.Port != nil && (*c.Server.Port < 0 || *c.Server.Port > 65535) {
		bad("server.port", "expected a port from 0 to 65535, got %d", *c.Server.Port)
	}
	if c.Server.ReadTimeout <= 0 {
		bad("server.readTimeout", "expected a positive duration such as 60s, got %s", c.Server.ReadTimeout.Std())
	}
	if c.Server.IdleTimeout <= 0 {
		bad("server.idleTimeout", "expected a positive duration such as 120s, got %s", c.Server.IdleTimeout.Std())
	}
	if a := c.Server.AdminAddr; a != "" && a != AdminOnAPIPort {
		if _, _, err := net.SplitHostPort(a); err != nil {
			bad("server.adminAddr", "expected host:port (or %q: on the API port), got %q", AdminOnAPIPort, a)
		}
	}
	if t := c.Server.TLS; (t.CertFile == "") != (t.KeyFile == "") {
		bad("server.tls", "set both certFile and keyFile, or neither")
	} else if t.ClientCAFile != "" && t.CertFile == "" {
		bad("server.tls.clientCAFile", "needs server.tls.certFile and keyFile: mutual TLS is TLS first")
	}
	if c.Server.ShutdownTimeout <= 0 {
		bad("server.shutdownTimeout", "expected a positive duration such as 15s, got %s", c.Server.ShutdownTimeout.Std())
	}
	if !slices.Contains([]string{"debug", "info", "warn", "error"}, c.Log.Level) {
		bad("log.level", "expected one of debug, info, warn, error, got %q", c.Log.Level)
	}
	if !slices.Contains([]string{"json", "text"}, c.Log.Format) {
		bad("log.format", "expected json or text, got %q", c.Log.Format)
	}
	if e := c.Telemetry.OTLPEndpoint; e != "" {
		if strings.Contains(e, "://") {
			if err := checkURL(e, "http", "https"); err != nil {
				bad("telemetry.otlpEndpoint", "%v", err)
			}
		} else if _, _, err := net.SplitHostPort(e); err != nil {
			bad("telemetry.otlpEndpoint", "expected host:port or an http(s):// URL, got %q", e)
		}
	}
	if n := c.Dev.SimNodes; n != nil && (*n < 0 || *n > 100000) {
		bad("dev.simNodes", "expected 0 to 100000, got %d", *n)
	}
	if n := c.Dev.SimMachines; n != nil && (*n < 0 || *n > MaxSimMachines) {
		bad("dev.simMachines", "expected 0 to %d, got %d", MaxSimMachines, *n)
	}
	if l := c.Gateway.Listen; l != "" {
		if _, port, err := net.SplitHostPort(l); err != nil || port == "" {
			bad("gateway.listen", "expected host:port (such as :8443), got %q", l)
		}
	}
	if l := c.Host.Gateway; l != "" {
		if _, port, err := net.SplitHostPort(l); err != nil || port == "" {
			bad("host.gateway", "expected host:port (such as :8443), got %q", l)
		}
	}
	if !gatewayIDRE.MatchString(c.Gateway.ID) {
		bad("gateway.id", "expected lower-case letters, digits, dots and dashes, got %q", c.Gateway.ID)
	}
	if c.Gateway.HeartbeatInterval <= 0 {
		bad("gateway.heartbeatInterval", "expected a positive duration, got %s", c.Gateway.HeartbeatInterval.Std())
	}
	if c.Gateway.AdmitRate < 0 {
		bad("gateway.admitRate", "expected a positive number of sessions per second, got %g", c.Gateway.AdmitRate)
	}
	if c.Gateway.AdmitBurst < 0 {
		bad("gateway.admitBurst", "expected a positive number of sessions, got %d", c.Gateway.AdmitBurst)
	}
	if c.Gateway.AdmitWait < 0 {
		bad("gateway.admitWait", "expected a positive duration, got %s", c.Gateway.AdmitWait.Std())
	}
	if c.Gateway.LivenessInterval <= 0 {
		bad("gateway.livenessInterval", "expected a positive duration, got %s", c.Gateway.LivenessInterval.Std())
	}
	var oldest, newest *agentrelease.Version
	for _, e := range []struct {
		field, v string
		to       **agentrelease.Version
	}{{"gateway.agentVersions.oldest", c.Gateway.AgentVersions.Oldest, &oldest}, {"gateway.agentVersions.newest", c.Gateway.AgentVersions.Newest, &newest}} {
		if e.v == "" {
			continue
		}
		v, err := agentrelease.ParseVersion(e.v)
		if err != nil {
			bad(e.field, "expected a semantic version such as v0.3.1, got %q", e.v)
			continue
		}
		*e.to = &v
	}
	if oldest != nil && newest != nil && oldest.Compare(*newest) > 0 {
		bad("gateway.agentVersions.newest", "expected a version not older than oldest (%s), got %s", c.Gateway.AgentVersions.Oldest, c.Gateway.AgentVersions.Newest)
	}
	if c.Commands.SweepInterval <= 0 {
		bad("commands.sweepInterval", "expected a positive duration, got %s", c.Commands.SweepInterval.Std())
	}
	r := c.Runtime
	for _, d := range []struct {
		field string
		v     Duration
	}{
		{"runtime.heartbeat", r.Heartbeat}, {"runtime.leaseTTL", r.LeaseTTL}, {"runtime.resyncEvery", r.ResyncEvery},
		{"runtime.poll", r.Poll}, {"runtime.pollBusDown", r.PollBusDown},
	} {
		if d.v <= 0 {
			bad(d.field, "expected a positive duration, got %s", d.v.Std())
		}
	}
	if r.ResyncJitter < 0 {
		bad("runtime.resyncJitter", "expected a duration of 0 or more, got %s", r.ResyncJitter.Std())
	}
	if r.Heartbeat > 0 && r.LeaseTTL < 2*r.Heartbeat {
		bad("runtime.leaseTTL", "expected at least two heartbeats (%s), got %s", (2 * r.Heartbeat).Std(), r.LeaseTTL.Std())
	}
	if r.Concurrency < 1 || r.Concurrency > 1024 {
		bad("runtime.concurrency", "expected 1 to 1024, got %d", r.Concurrency)
	}
	if r.Batch < 1 || r.Batch > 10000 {
		bad("runtime.batch", "expected 1 to 10000, got %d", r.Batch)
	}
	js := c.JoinService
	if !trustDomainRE.MatchString(js.TrustDomain) {
		bad("joinService.trustDomain", "expected a SPIFFE trust domain (lowercase letters, digits, '.', '-', '_'), got %q", js.TrustDomain)
	}
	if (js.CACertFile == "") != (js.CAKeyFile == "") {
		field := "joinService.caKeyFile"
		if js.CACertFile == "" {
			field = "joinService.caCertFile"
		}
		bad(field, "set caCertFile and caKeyFile together")
	}
	errs = append(errs, c.validateJoinServiceRelay()...)
	errs = append(errs, c.Capacity.validate()...)
	errs = append(errs, c.Nodes.validate(&c.Capacity)...)
	errs = append(errs, c.Health.validate()...)
	errs = append(errs, c.Fleet.validate()...)
	errs = append(errs, c.IAM.validate()...)
	errs = append(errs, c.Events.validate()...)
	errs = append(errs, c.Webhooks.validate()...)
	errs = append(errs, c.Providers.validate()...)
	errs = append(errs, c.Audit.validate()...)
	errs = append(errs, c.Secrets.validate()...)
	errs = append(errs, c.Metal.validate()...)
	errs = append(errs, c.validateInterfaces()...)
	errs = append(errs, c.Tunnels.validate()...)
	return errors.Join(errs...)
}

var gatewayIDRE = regexp.MustCompile(`^[a-z0-9][a-z0-9.-]{0,62}$`)

var trustDomainRE = regexp.MustCompile(`^[a-z0-9._-]{1,255}$`)

// RequireJoinServiceKeys returns INVALID_CONFIG naming the field when the
// node CA or the HPKE key has no source (files, or keyDir), for the roles
// that hold them (joinservice, and the gateway hosting it).
func (c *Config) RequireJoinServiceKeys() error {
	js := c.JoinService
	var errs []error
	if js.KeyDir == "" && js.CACertFile == "" {
		errs = append(errs, fault.New(fault.InvalidConfig, "joinService.caCertFile", "required: the node CA's certificate and key files (or joinService.keyDir to generate them, for development)"))
	}
	if js.KeyDir == "" && js.HPKEKeyFile == "" {
		errs = append(errs, fault.New(fault.InvalidConfig, "joinService.hpkeKeyFile", "required: joinservice's HPKE key file (or joinService.keyDir to generate one, for development)"))
	}
	return errors.Join(errs...)
}

// RequireDatabase returns INVALID_CONFIG on database.url when no database is
// configured, for the modes that cannot resolve one themselves.
func (c *Config) RequireDatabase() error {
	if c.Database.URL == "" {
		return fault.New(fault.InvalidConfig, "database.url", "required: set database.url in the configuration file, or BC_DATABASE_URL or DATABASE_URL")
	}
	return nil
}

func checkDatabaseURL(s string) error {
	if strings.Contains(s, "://") {
		u, err := url.Parse(s)
		if err != nil {
			return fmt.Errorf("expected a postgres:// URL: %v", errors.Unwrap(err))
		}
		if u.Scheme != "postgres" && u.Scheme != "postgresql" {
			return fmt.Errorf("expected a postgres:// or postgresql:// URL, got scheme %q", u.Scheme)
		}
	}
	if _, err := pgconn.ParseConfig(s); err != nil {
		return fmt.Errorf("expected a postgres:// URL or key=value DSN: %v", err)
	}
	return nil
}

func checkURL(s string, schemes ...string) error {
	u, err := url.Parse(s)
	if err != nil || u.Host == "" {
		return fmt.Errorf("expected a %s://host:port URL, got %q", schemes[0], s)
	}
	if !slices.Contains(schemes, u.Scheme) {
		return fmt.Errorf("expected a URL with scheme %s, got %q", strings.Join(schemes, ", "), u.Scheme)
	}
	return nil
}

// ParsePort parses a --port style value.
func ParsePort(s string) (int, error) {
	p, err := strconv.Atoi(s)
	if err != nil || p < 0 || p > 65535 {
		return 0, fault.New(fault.InvalidConfig, "server.port", "expected a port from 0 to 65535, got %q", s)
	}
	return p, nil
}
