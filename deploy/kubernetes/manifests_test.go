package kubernetes_test

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/bettercompute/bettercompute/pkg/config"
)

var overlays = []string{"dev", "ha"}

// deployables are the control plane's Deployments, each named for the one
// role it runs (`serve --roles <name>`). From pkg/config's role table
// (roleTable): the built deployables, with scheduler hosted by placer and
// sinks by outbox-relay (services/app: schedulerHosted, relayHosted).
// TestEveryBuiltRoleIsDeployed fails when a role is built and not here.
var deployables = []string{
	"api", "joinservice", "gateway", "nodespec-controller", "controllers",
	"placer", "command-sweeper", "outbox-relay", "metal", "vps", "iam",
}

// hostedBy are the worker roles a deployable runs for the spec
// (services/app/capacity.go, services/app/relay.go).
var hostedBy = map[config.Role]string{config.RoleScheduler: "placer", config.RoleSinks: "outbox-relay"}

// secretReaders says which roles may mount each PKI Secret: the node CA and
// the HPKE key live in joinservice alone, the command-signing and audit keys
// in the roles that sign (docs/pki.md); a gateway holds only its own
// certificate and the trust bundle.
var secretReaders = map[string][]string{
	"bc-gateway-tls":      {"gateway"},
	"bc-ca-bundle":        {"gateway"},
	"bc-node-ca":          {"joinservice"},
	"bc-joinservice-hpke": {"joinservice"},
	"bc-command-signing":  {"api", "controllers", "metal"},
	"bc-audit-signing":    {"api", "controllers", "metal"},
	"bc-secrets-key":      {"api", "controllers", "metal", "vps"},
}

// requiredFiles are the key files each role must be configured with.
var requiredFiles = map[string][]string{
	"joinservice": {"joinService.caCertFile", "joinService.caKeyFile", "joinService.hpkeKeyFile"},
	"api":         {"commands.signingKeyFile", "audit.signingKeyFile"},
	"controllers": {"commands.signingKeyFile", "audit.signingKeyFile"},
	"metal":       {"commands.signingKeyFile", "audit.signingKeyFile", "secrets.keyFile"},
	"gateway":     {"gateway.tls.certFile", "gateway.tls.keyFile", "gateway.tls.caFile"},
}

// secretValues stand in for the Secrets the operator creates, so the rendered
// configuration can be loaded and validated.
var secretValues = map[string]string{
	"bc-database/url": "postgres://bc:secret@pgbouncer:5432/bc?sslmode=disable",
	"bc-postgres/url": "postgres://bc:secret@db.example:5432/bc?sslmode=verify-full",
}

// manifests is one rendered overlay, decoded.
type manifests struct {
	overlay      string
	deployments  map[string]*appsv1.Deployment
	statefulSets map[string]*appsv1.StatefulSet
	services     map[string]*corev1.Service
	configMaps   map[string]*corev1.ConfigMap
	jobs         map[string]*batchv1.Job
	pdbs         map[string]*policyv1.PodDisruptionBudget
	hpas         map[string]*autoscalingv2.HorizontalPodAutoscaler
	other        int // namespaces and service accounts
}

// render builds dir with kustomize's Go API, as `kubectl apply -k` would.
func render(t *testing.T, dir string) *manifests {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	out := &manifests{
		overlay:      filepath.Base(dir),
		deployments:  map[string]*appsv1.Deployment{},
		statefulSets: map[string]*appsv1.StatefulSet{},
		services:     map[string]*corev1.Service{},
		configMaps:   map[string]*corev1.ConfigMap{},
		jobs:         map[string]*batchv1.Job{},
		pdbs:         map[string]*policyv1.PodDisruptionBudget{},
		hpas:         map[string]*autoscalingv2.HorizontalPodAutoscaler{},
	}
	for _, r := range m.Resources() {
		b, err := r.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		if err := out.add(r.GetApiVersion(), r.GetKind(), b); err != nil {
			t.Errorf("%s: %s %s: %v", dir, r.GetKind(), r.GetName(), err)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return out
}

// add decodes one object strictly (an unknown or duplicate field is an
// error) into its Kubernetes API type.
func (m *manifests) add(apiVersion, kind string, b []byte) error {
	var err error
	switch apiVersion + " " + kind {
	case "apps/v1 Deployment":
		err = decodeInto(b, m.deployments)
	case "apps/v1 StatefulSet":
		err = decodeInto(b, m.statefulSets)
	case "v1 Service":
		err = decodeInto(b, m.services)
	case "v1 ConfigMap":
		err = decodeInto(b, m.configMaps)
	case "batch/v1 Job":
		err = decodeInto(b, m.jobs)
	case "policy/v1 PodDisruptionBudget":
		err = decodeInto(b, m.pdbs)
	case "autoscaling/v2 HorizontalPodAutoscaler":
		err = decodeInto(b, m.hpas)
	case "v1 Namespace":
		err = yaml.UnmarshalStrict(b, &corev1.Namespace{})
		m.other++
	case "v1 ServiceAccount":
		err = yaml.UnmarshalStrict(b, &corev1.ServiceAccount{})
		m.other++
	default:
		return fmt.Errorf("unexpected %s %s: add it to this test", apiVersion, kind)
	}
	return err
}

// object is what decodeInto needs of a Kubernetes API type.
type object interface{ GetName() string }

func decodeInto[T any, PT interface {
	*T
	object
}](b []byte, into map[string]PT) error {
	var v T
	if err := yaml.UnmarshalStrict(b, &v); err != nil {
		return err
	}
	p := PT(&v)
	if _, dup := into[p.GetName()]; dup {
		return fmt.Errorf("two objects named %q", p.GetName())
	}
	into[p.GetName()] = p
	return nil
}

func renderAll(t *testing.T) map[string]*manifests {
	t.Helper()
	out := map[string]*manifests{}
	for _, o := range overlays {
		out[o] = render(t, filepath.Join("overlays", o))
	}
	return out
}

// TestStrictDecodingCatchesTypos proves the decoding is strict: a misspelt
// field that kustomize passes through fails the render.
func TestStrictDecodingCatchesTypos(t *testing.T) {
	// The base, copied into memory beside an overlay with a misspelt field.
	fsys := filesys.MakeFsInMemory()
	files, err := filepath.Glob("base/*")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := fsys.WriteFile("/"+f, b); err != nil {
			t.Fatal(err)
		}
	}
	kust := `apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../base]
patches:
  - target: {kind: Deployment, name: api}
    patch: |-
      apiVersion: apps/v1
      kind: Deployment
      metadata: {name: api}
      spec:
        template:
          spec:
            containers:
              - name: better-compute
                readinesProbe: {httpGet: {path: /readyz, port: http}}
`
	if err := fsys.WriteFile("/typo/kustomization.yaml", []byte(kust)); err != nil {
		t.Fatal(err)
	}
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fsys, "/typo")
	if err != nil {
		t.Fatalf("kustomize build: %v", err)
	}
	var r interface{ AsYAML() ([]byte, error) }
	for _, x := range m.Resources() {
		if x.GetKind() == "Deployment" && x.GetName() == "api" {
			r = x
		}
	}
	if r == nil {
		t.Fatal("no Deployment api in the render")
	}
	b, err := r.AsYAML()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), "readinesProbe") {
		t.Fatalf("kustomize dropped the misspelt field; the test proves nothing:\n%s", b)
	}
	err = (&manifests{deployments: map[string]*appsv1.Deployment{}}).add("apps/v1", "Deployment", b)
	if err == nil || !strings.Contains(err.Error(), "readinesProbe") {
		t.Fatalf("strict decoding of a misspelt field: %v, want an unknown-field error naming it", err)
	}
}

// TestDeployments checks every Deployment of every overlay: probes, resources,
// a PodDisruptionBudget, topology spread, and the control plane's roles and
// configuration.
func TestDeployments(t *testing.T) {
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			var seen []string
			for name, d := range m.deployments {
				checkPodWorkload(t, m, "Deployment "+name, d.Spec.Selector, &d.Spec.Template)
				if cp := controlPlaneContainer(d.Spec.Template.Spec); cp != nil {
					seen = append(seen, name)
					checkControlPlane(t, m, name, &d.Spec.Template.Spec, cp)
				}
			}
			slices.Sort(seen)
			want := slices.Sorted(slices.Values(deployables))
			if !slices.Equal(seen, want) {
				t.Errorf("control-plane Deployments %v, want one per deployable %v", seen, want)
			}
			for name, s := range m.statefulSets {
				checkPodWorkload(t, m, "StatefulSet "+name, s.Spec.Selector, &s.Spec.Template)
			}
		})
	}
}

// checkPodWorkload checks what every long-running workload needs.
func checkPodWorkload(t *testing.T, m *manifests, what string, sel *metav1.LabelSelector, tpl *corev1.PodTemplateSpec) {
	t.Helper()
	podLabels := labels.Set(tpl.Labels)
	if !selects(t, sel, podLabels) {
		t.Errorf("%s: selector %v does not select its own pods %v", what, sel, tpl.Labels)
	}
	for _, c := range tpl.Spec.Containers {
		where := what + " container " + c.Name
		if c.ReadinessProbe == nil || c.LivenessProbe == nil {
			t.Errorf("%s: needs a readiness and a liveness probe", where)
		}
		for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
			if p != nil && !probePortDeclared(p, c.Ports) {
				t.Errorf("%s: a probe targets a port the container does not declare", where)
			}
		}
		if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
			t.Errorf("%s: needs CPU and memory requests and a memory limit, has %+v", where, c.Resources)
		}
		if c.Resources.Limits.Memory().Cmp(*c.Resources.Requests.Memory()) < 0 {
			t.Errorf("%s: memory limit below its request", where)
		}
	}
	var pdbs []string
	for name, p := range m.pdbs {
		if selects(t, p.Spec.Selector, podLabels) {
			pdbs = append(pdbs, name)
		}
	}
	if len(pdbs) != 1 {
		t.Errorf("%s: %d PodDisruptionBudgets select its pods (%v), want 1", what, len(pdbs), pdbs)
	}
	keys := map[string]bool{}
	for _, c := range tpl.Spec.TopologySpreadConstraints {
		if !selects(t, c.LabelSelector, podLabels) {
			t.Errorf("%s: topology spread on %s selects other pods (%v)", what, c.TopologyKey, c.LabelSelector)
		}
		keys[c.TopologyKey] = true
		if m.overlay == "ha" && c.TopologyKey == corev1.LabelHostname && c.WhenUnsatisfiable != corev1.DoNotSchedule {
			t.Errorf("%s: ha must never put two of its pods on one host", what)
		}
	}
	if !keys[corev1.LabelTopologyZone] || !keys[corev1.LabelHostname] {
		t.Errorf("%s: needs topology spread over zones and hosts, has %v", what, keys)
	}
}

func selects(t *testing.T, sel *metav1.LabelSelector, set labels.Set) bool {
	t.Helper()
	if sel == nil {
		return false
	}
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		t.Errorf("selector %v: %v", sel, err)
		return false
	}
	return !s.Empty() && s.Matches(set)
}

func probePortDeclared(p *corev1.Probe, ports []corev1.ContainerPort) bool {
	var port intstr.IntOrString
	switch {
	case p.HTTPGet != nil:
		port = p.HTTPGet.Port
	case p.TCPSocket != nil:
		port = p.TCPSocket.Port
	default:
		return true // exec and gRPC probes name no container port
	}
	_, ok := containerPort(ports, port)
	return ok
}

func containerPort(ports []corev1.ContainerPort, p intstr.IntOrString) (int32, bool) {
	for _, cp := range ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return cp.ContainerPort, true
		}
	}
	return 0, false
}

// controlPlaneContainer is the pod's better-compute container, or nil.
func controlPlaneContainer(spec corev1.PodSpec) *corev1.Container {
	for i, c := range spec.Containers {
		if strings.Contains(c.Image, "better-compute") {
			return &spec.Containers[i]
		}
	}
	return nil
}

// serveArgs is `better-compute serve` as the manifests run it.
type serveArgs struct {
	command    []string
	roles      []string
	configPath string
	noMigrate  bool
}

// parseArgs reads better-compute's arguments: the subcommand words, then the
// flags the manifests use (services/cli/serve: --roles, --config, --no-migrate).
func parseArgs(t *testing.T, where string, args []string) serveArgs {
	t.Helper()
	var a serveArgs
	for i := 0; i < len(args); i++ {
		switch arg := args[i]; {
		case arg == "--roles" || arg == "--config":
			if i+1 == len(args) {
				t.Fatalf("%s: %s without a value", where, arg)
			}
			i++
			if arg == "--roles" {
				a.roles = append(a.roles, args[i])
			} else {
				a.configPath = args[i]
			}
		case arg == "--no-migrate":
			a.noMigrate = true
		case strings.HasPrefix(arg, "-"):
			t.Errorf("%s: flag %s is not one this test knows (services/cli/serve)", where, arg)
		default:
			a.command = append(a.command, arg)
		}
	}
	return a
}

func checkControlPlane(t *testing.T, m *manifests, name string, spec *corev1.PodSpec, c *corev1.Container) {
	t.Helper()
	where := "Deployment " + name
	a := parseArgs(t, where, c.Args)
	if !slices.Equal(a.command, []string{"serve"}) || !a.noMigrate {
		t.Errorf("%s: args %v, want serve … --no-migrate (the migrate Job applies the schema)", where, c.Args)
	}
	roles, err := config.ParseRoles(a.roles)
	if err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	// A deployable runs its role and the finer roles that role includes
	// (controllers: the nodespec controller, the workflows, the sweeper).
	if want, _ := config.ParseRoles([]string{name}); !slices.Equal(roles, want) {
		t.Errorf("%s: runs roles %v, want %v", where, roles, want)
	}
	for _, r := range roles {
		if !slices.Contains(config.BuiltRoles, r) {
			t.Errorf("%s: role %q is not built in this release", where, r)
		}
	}

	cfg := loadConfig(t, m, where, spec, c, a.configPath)
	cfg.Roles = a.roles
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		t.Errorf("%s: the configuration does not validate:\n%v", where, err)
	}
	if !cfg.Database.PgBouncer || !cfg.Server.NoMigrate {
		t.Errorf("%s: database.pgbouncer %v, server.noMigrate %v: every pod goes through PgBouncer and leaves the schema to the Job", where, cfg.Database.PgBouncer, cfg.Server.NoMigrate)
	}
	checkDatabaseSecret(t, where, c)

	// Probes: the paths every process serves on server.port (services/app:
	// /healthz while it runs, /readyz when the database and schema are).
	httpPort, ok := containerPort(c.Ports, intstr.FromString("http"))
	if !ok || int(httpPort) != *cfg.Server.Port {
		t.Errorf("%s: container port http %d, server.port %d", where, httpPort, *cfg.Server.Port)
	}
	for _, p := range []struct {
		probe *corev1.Probe
		path  string
	}{{c.ReadinessProbe, "/readyz"}, {c.LivenessProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s: want an HTTP probe of %s", where, p.path)
			continue
		}
		if port, _ := containerPort(c.Ports, p.probe.HTTPGet.Port); port != httpPort {
			t.Errorf("%s: %s probed on %d, served on %d", where, p.path, port, httpPort)
		}
	}
	if _, port, err := net.SplitHostPort(cfg.Server.AdminAddr); err != nil {
		t.Errorf("%s: server.adminAddr %q: %v", where, cfg.Server.AdminAddr, err)
	} else if mp, _ := containerPort(c.Ports, intstr.FromString("metrics")); strconv.Itoa(int(mp)) != port {
		t.Errorf("%s: /metrics served on %s (server.adminAddr) but the container port metrics is %d", where, port, mp)
	} else if ann := m.deployments[name].Spec.Template.Annotations["prometheus.io/port"]; ann != port {
		t.Errorf("%s: the scrape annotation names port %q, metrics are on %s", where, ann, port)
	}

	if name == "gateway" {
		// It relays to joinservice, a Service of the render, and so holds
		// no node CA, no HPKE key and no signing key (config: RelaysJoins).
		if !cfg.RelaysJoins() {
			t.Errorf("%s: gateway.joinService is unset: the gateway would host joinservice and need its keys", where)
		}
		if err := cfg.RequireGatewayTLS(); err != nil {
			t.Errorf("%s: %v", where, err)
		}
		for _, a := range cfg.Gateway.JoinService {
			checkServiceAddr(t, m, where+" gateway.joinService", a)
		}
		_, port, _ := net.SplitHostPort(cfg.Gateway.Listen)
		gp, ok := containerPort(c.Ports, intstr.FromString("gateway"))
		if !ok || strconv.Itoa(int(gp)) != port {
			t.Errorf("%s: gateway.listen %q, container port gateway %d", where, cfg.Gateway.Listen, gp)
		}
	}
	if name == "joinservice" {
		if err := cfg.RequireJoinServiceKeys(); err != nil {
			t.Errorf("%s: %v", where, err)
		}
		if !slices.Contains(cfg.JoinService.Hosts, "joinservice") {
			t.Errorf("%s: joinService.hosts %v must name the Service the gateways dial", where, cfg.JoinService.Hosts)
		}
		_, port, _ := net.SplitHostPort(cfg.JoinService.Listen)
		if jp, ok := containerPort(c.Ports, intstr.FromString("join")); !ok || strconv.Itoa(int(jp)) != port {
			t.Errorf("%s: joinService.listen %q, container port join %d", where, cfg.JoinService.Listen, jp)
		}
	}
	checkNATSURL(t, m, where, cfg.NATS.URL)
	checkKeyFiles(t, name, spec, c, cfg)
}

// loadConfig loads the container's configuration through pkg/config, as the
// process would: the mounted ConfigMap's file, then its environment.
func loadConfig(t *testing.T, m *manifests, where string, spec *corev1.PodSpec, c *corev1.Container, path string) *config.Config {
	t.Helper()
	data, ok := mountedConfigMapFile(m, spec, c, path)
	if !ok {
		t.Fatalf("%s: --config %q is not a file of a mounted ConfigMap", where, path)
	}
	file := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(file, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	known := map[string]bool{}
	for _, v := range config.EnvVars() {
		for n := range strings.SplitSeq(v[1], ", ") {
			known[n] = true
		}
	}
	env := map[string]string{}
	for _, e := range c.Env {
		if !known[e.Name] {
			t.Errorf("%s: environment variable %s is no configuration setting (docs/configuration.md)", where, e.Name)
		}
		if _, dup := env[e.Name]; dup {
			t.Errorf("%s: %s set twice", where, e.Name)
		}
		env[e.Name] = envValue(t, where, spec, e)
	}
	cfg, err := config.Load(config.LoadOptions{Path: file, LookupEnv: func(k string) (string, bool) { v, ok := env[k]; return v, ok }})
	if err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	return cfg
}

func envValue(t *testing.T, where string, _ *corev1.PodSpec, e corev1.EnvVar) string {
	t.Helper()
	switch {
	case e.ValueFrom == nil:
		return e.Value
	case e.ValueFrom.SecretKeyRef != nil:
		ref := e.ValueFrom.SecretKeyRef
		v, ok := secretValues[ref.Name+"/"+ref.Key]
		if !ok {
			t.Errorf("%s: %s from Secret %s key %s, which this test does not know", where, e.Name, ref.Name, ref.Key)
		}
		return v
	case e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name":
		return "gateway-5c9d7f6b8-x2x7k" // a pod name
	}
	t.Errorf("%s: %s: unexpected valueFrom %+v", where, e.Name, e.ValueFrom)
	return ""
}

// mountedConfigMapFile returns the content of path when the container mounts
// it from a ConfigMap of the render.
func mountedConfigMapFile(m *manifests, spec *corev1.PodSpec, c *corev1.Container, path string) (string, bool) {
	for _, vm := range c.VolumeMounts {
		v := volume(spec, vm.Name)
		if v == nil || v.ConfigMap == nil {
			continue
		}
		cm := m.configMaps[v.ConfigMap.Name]
		if cm == nil {
			continue
		}
		if vm.SubPath != "" && vm.MountPath == path {
			d, ok := cm.Data[vm.SubPath]
			return d, ok
		}
		if rel, ok := strings.CutPrefix(path, strings.TrimSuffix(vm.MountPath, "/")+"/"); ok && vm.SubPath == "" {
			d, ok := cm.Data[rel]
			return d, ok
		}
	}
	return "", false
}

func volume(spec *corev1.PodSpec, name string) *corev1.Volume {
	for i, v := range spec.Volumes {
		if v.Name == name {
			return &spec.Volumes[i]
		}
	}
	return nil
}

func checkDatabaseSecret(t *testing.T, where string, c *corev1.Container) {
	t.Helper()
	for _, e := range c.Env {
		if e.Name == "BC_DATABASE_URL" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil &&
			e.ValueFrom.SecretKeyRef.Name == "bc-database" && e.ValueFrom.SecretKeyRef.Key == "url" {
			return
		}
	}
	t.Errorf("%s: BC_DATABASE_URL must come from the Secret bc-database, key url", where)
}

// checkNATSURL checks every nats.url server is a Service of the render with
// that port.
func checkNATSURL(t *testing.T, m *manifests, where, urls string) {
	t.Helper()
	for u := range strings.SplitSeq(urls, ",") {
		checkServiceAddr(t, m, where+" nats.url", strings.TrimPrefix(strings.TrimSpace(u), "nats://"))
	}
}

// checkServiceAddr checks host:port is a port of a Service of the render.
func checkServiceAddr(t *testing.T, m *manifests, where, hostPort string) {
	t.Helper()
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil {
		t.Errorf("%s: %q: %v", where, hostPort, err)
		return
	}
	svc := m.services[host]
	if svc == nil || !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool { return strconv.Itoa(int(p.Port)) == port }) {
		t.Errorf("%s: %q is no Service port of the render", where, hostPort)
	}
}

// checkKeyFiles checks that every key file the configuration names is a
// Secret item mounted into the container, that every mounted Secret item is
// named by a setting, and that each PKI Secret is mounted only where its
// role reads it.
func checkKeyFiles(t *testing.T, role string, spec *corev1.PodSpec, c *corev1.Container, cfg *config.Config) {
	t.Helper()
	where := "Deployment " + role
	mounted := map[string]string{} // file path -> secret/key
	for _, vm := range c.VolumeMounts {
		v := volume(spec, vm.Name)
		if v == nil {
			t.Errorf("%s: volumeMount %s has no volume", where, vm.Name)
			continue
		}
		if v.Secret == nil {
			continue
		}
		readers, ok := secretReaders[v.Secret.SecretName]
		if !ok {
			t.Errorf("%s: mounts Secret %s, which this test does not know", where, v.Secret.SecretName)
		} else if !slices.Contains(readers, role) {
			t.Errorf("%s: mounts Secret %s, which only %v may hold", where, v.Secret.SecretName, readers)
		}
		if len(v.Secret.Items) == 0 {
			t.Errorf("%s: Secret volume %s must list its items (the file names are configuration)", where, v.Name)
		}
		for _, it := range v.Secret.Items {
			mounted[filepath.Join(vm.MountPath, it.Path)] = v.Secret.SecretName + "/" + it.Key
		}
	}
	used := map[string]bool{}
	for path, file := range keyFiles(cfg) {
		if _, ok := mounted[file]; !ok {
			t.Errorf("%s: %s is %s, which no Secret mounted in the pod provides", where, path, file)
		}
		used[file] = true
	}
	for file, src := range mounted {
		if !used[file] {
			t.Errorf("%s: mounts %s at %s but no setting names it", where, src, file)
		}
	}
	for _, path := range requiredFiles[role] {
		if keyFiles(cfg)[path] == "" {
			t.Errorf("%s: %s must be set", where, path)
		}
	}
}

// keyFiles returns every set configuration field whose YAML name ends in
// "File", by YAML path.
func keyFiles(cfg *config.Config) map[string]string {
	out := map[string]string{}
	var walk func(v reflect.Value, prefix string)
	walk = func(v reflect.Value, prefix string) {
		for i := range v.NumField() {
			f := v.Type().Field(i)
			name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if name == "" || name == "-" {
				continue
			}
			path := strings.TrimPrefix(prefix+"."+name, ".")
			switch fv := v.Field(i); {
			case fv.Kind() == reflect.Struct:
				walk(fv, path)
			case fv.Kind() == reflect.String && strings.HasSuffix(name, "File") && fv.String() != "":
				out[path] = fv.String()
			}
		}
	}
	walk(reflect.ValueOf(cfg).Elem(), "")
	return out
}

// TestEveryBuiltRoleIsDeployed fails when pkg/config builds a role that no
// Deployment runs (directly or through the deployable that hosts it).
func TestEveryBuiltRoleIsDeployed(t *testing.T) {
	for _, r := range config.BuiltRoles {
		if slices.Contains(deployables, string(r)) {
			continue
		}
		if h, ok := hostedBy[r]; ok && slices.Contains(deployables, h) {
			continue
		}
		t.Errorf("role %q is built (pkg/config roleTable) but no Deployment runs it: add one to deploy/kubernetes/base", r)
	}
}

// TestAutoscaling checks the HPAs: each scales a Deployment that leaves the
// count to it, on the metric its role scales by.
func TestAutoscaling(t *testing.T) {
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			for name, h := range m.hpas {
				ref := h.Spec.ScaleTargetRef
				d := m.deployments[ref.Name]
				if ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" || d == nil {
					t.Errorf("HPA %s scales %s %s, not a Deployment of the render", name, ref.Kind, ref.Name)
					continue
				}
				if d.Spec.Replicas != nil {
					t.Errorf("Deployment %s sets replicas and has HPA %s: kubectl apply would reset the HPA's count", d.Name, name)
				}
				if h.Spec.MinReplicas == nil || *h.Spec.MinReplicas < 1 || *h.Spec.MinReplicas > h.Spec.MaxReplicas {
					t.Errorf("HPA %s: minReplicas %v, maxReplicas %d", name, h.Spec.MinReplicas, h.Spec.MaxReplicas)
				}
			}
			for _, want := range []struct {
				role   string
				typ    autoscalingv2.MetricSourceType
				metric string
			}{
				{"api", autoscalingv2.ResourceMetricSourceType, "cpu"},
				{"gateway", autoscalingv2.PodsMetricSourceType, gatewaySessionsMetric},
				{"controllers", autoscalingv2.ExternalMetricSourceType, queueDepthMetric},
			} {
				h := hpaFor(m, want.role)
				if h == nil {
					t.Errorf("%s has no HPA", want.role)
					continue
				}
				if len(h.Spec.Metrics) != 1 || h.Spec.Metrics[0].Type != want.typ || metricName(h.Spec.Metrics[0]) != want.metric {
					t.Errorf("HPA of %s scales on %+v, want %s metric %s", want.role, h.Spec.Metrics, want.typ, want.metric)
				}
			}
			if h := hpaFor(m, "controllers"); h != nil && len(h.Spec.Metrics) == 1 && h.Spec.Metrics[0].External != nil {
				sel := h.Spec.Metrics[0].External.Metric.Selector
				for _, e := range sel.MatchExpressions {
					for _, kind := range e.Values {
						if !sourceMentions(t, `"`+kind+`"`, "../../services", "../../pkg") {
							t.Errorf("controllers HPA counts work kind %q, which no source names", kind)
						}
					}
				}
			}
		})
	}
}

// The metrics the HPAs read, checked against the code that serves them.
const (
	gatewaySessionsMetric = "bettercompute_gateway_sessions"
	queueDepthMetric      = "bettercompute_reconcile_queue_depth"
)

func TestMetricsExist(t *testing.T) {
	for metric, dir := range map[string]string{gatewaySessionsMetric: "../../services/gateway", queueDepthMetric: "../../pkg/reconcile"} {
		if !sourceMentions(t, `"`+metric+`"`, dir) {
			t.Errorf("an HPA scales on %s, which %s does not serve", metric, dir)
		}
	}
}

// sourceMentions reports whether a non-test Go file under dirs contains s.
func sourceMentions(t *testing.T, s string, dirs ...string) bool {
	t.Helper()
	found := false
	for _, dir := range dirs {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil || found || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			b, err := os.ReadFile(path)
			found = err == nil && strings.Contains(string(b), s)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return found
}

func hpaFor(m *manifests, deployment string) *autoscalingv2.HorizontalPodAutoscaler {
	for _, h := range m.hpas {
		if h.Spec.ScaleTargetRef.Name == deployment {
			return h
		}
	}
	return nil
}

func metricName(s autoscalingv2.MetricSpec) string {
	switch {
	case s.Resource != nil:
		return string(s.Resource.Name)
	case s.Pods != nil:
		return s.Pods.Metric.Name
	case s.External != nil:
		return s.External.Metric.Name
	case s.Object != nil:
		return s.Object.Metric.Name
	}
	return ""
}

// replicas is what a Deployment runs at the least: its HPA's minimum, or its
// own count.
func replicas(m *manifests, d *appsv1.Deployment) int32 {
	if h := hpaFor(m, d.Name); h != nil && h.Spec.MinReplicas != nil {
		return *h.Spec.MinReplicas
	}
	if d.Spec.Replicas == nil {
		return 1
	}
	return *d.Spec.Replicas
}

// TestHAOverDev checks ha runs more of every Deployment than dev, and at
// least two of each (one pod is no availability).
func TestHAOverDev(t *testing.T) {
	all := renderAll(t)
	dev, ha := all["dev"], all["ha"]
	for name, hd := range ha.deployments {
		dd := dev.deployments[name]
		if dd == nil {
			t.Errorf("Deployment %s is in ha, not in dev", name)
			continue
		}
		if h, d := replicas(ha, hd), replicas(dev, dd); h <= d || h < 2 {
			t.Errorf("Deployment %s: ha runs %d, dev %d: ha must run more, and at least 2", name, h, d)
		}
		if h, d := hpaFor(ha, name), hpaFor(dev, name); h != nil && d != nil && h.Spec.MaxReplicas <= d.Spec.MaxReplicas {
			t.Errorf("HPA of %s: ha may grow to %d, dev to %d", name, h.Spec.MaxReplicas, d.Spec.MaxReplicas)
		}
	}
	if len(ha.deployments) != len(dev.deployments) {
		t.Errorf("ha has %d Deployments, dev %d", len(ha.deployments), len(dev.deployments))
	}
	if got := ha.gatewayMinimum(); got < 3 {
		t.Errorf("ha runs at least %d gateways, want at least three (spec: at least three per region)", got)
	}
}

func (m *manifests) gatewayMinimum() int32 { return replicas(m, m.deployments["gateway"]) }

// TestServices checks every Service selects pods of the render and targets
// ports they declare, and the gateway's is an L4 load balancer.
func TestServices(t *testing.T) {
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			for name, s := range m.services {
				pods := m.podsSelectedBy(s.Spec.Selector)
				if len(pods) == 0 {
					t.Errorf("Service %s selects no pods of the render", name)
				}
				for _, p := range s.Spec.Ports {
					for _, pod := range pods {
						if !slices.ContainsFunc(pod.Containers, func(c corev1.Container) bool { _, ok := containerPort(c.Ports, p.TargetPort); return ok }) {
							t.Errorf("Service %s port %s targets %s, which its pods do not declare", name, p.Name, p.TargetPort.String())
						}
					}
				}
			}
			gw := m.services["gateway"]
			if gw == nil {
				t.Fatal("no gateway Service")
			}
			if gw.Spec.Type != corev1.ServiceTypeLoadBalancer {
				t.Errorf("gateway Service is %s, want LoadBalancer (L4, TLS passthrough)", gw.Spec.Type)
			}
			for _, p := range gw.Spec.Ports {
				if p.Protocol != corev1.ProtocolTCP || p.TargetPort.String() != "gateway" {
					t.Errorf("gateway Service port %+v: want TCP to the gateway's mutual-TLS port, passed through", p)
				}
			}
			for name, s := range m.services {
				if name != "gateway" && s.Spec.Type != corev1.ServiceTypeClusterIP && s.Spec.Type != "" {
					t.Errorf("Service %s is %s: only the gateway is exposed", name, s.Spec.Type)
				}
			}
		})
	}
}

func (m *manifests) podsSelectedBy(sel map[string]string) []corev1.PodSpec {
	if len(sel) == 0 {
		return nil
	}
	s := labels.SelectorFromSet(sel)
	var out []corev1.PodSpec
	for _, d := range m.deployments {
		if s.Matches(labels.Set(d.Spec.Template.Labels)) {
			out = append(out, d.Spec.Template.Spec)
		}
	}
	for _, st := range m.statefulSets {
		if s.Matches(labels.Set(st.Spec.Template.Labels)) {
			out = append(out, st.Spec.Template.Spec)
		}
	}
	return out
}

// TestMigrateJob checks the one-shot `better-compute migrate up`, with the
// deployables' configuration and database.
func TestMigrateJob(t *testing.T) {
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			j := m.jobs["migrate"]
			if j == nil {
				t.Fatal("no Job migrate")
			}
			spec := &j.Spec.Template.Spec
			c := controlPlaneContainer(*spec)
			if c == nil {
				t.Fatal("the migrate Job runs no better-compute container")
			}
			a := parseArgs(t, "Job migrate", c.Args)
			if !slices.Equal(a.command, []string{"migrate", "up"}) || len(a.roles) != 0 {
				t.Errorf("Job migrate runs %v, want migrate up", c.Args)
			}
			if spec.RestartPolicy != corev1.RestartPolicyOnFailure && spec.RestartPolicy != corev1.RestartPolicyNever {
				t.Errorf("Job migrate restartPolicy %q", spec.RestartPolicy)
			}
			cfg := loadConfig(t, m, "Job migrate", spec, c, a.configPath)
			cfg.Defaults()
			if err := cfg.Validate(); err != nil {
				t.Errorf("Job migrate: %v", err)
			}
			if err := cfg.RequireDatabase(); err != nil {
				t.Error(err)
			}
			checkDatabaseSecret(t, "Job migrate", c)
			if !cfg.Database.PgBouncer {
				t.Error("Job migrate goes through PgBouncer: database.pgbouncer must be set (a table-row lock, not a session advisory lock)")
			}
		})
	}
}

// TestNATS checks the bus: three JetStream servers routed to each other
// through a headless Service.
func TestNATS(t *testing.T) {
	route := regexp.MustCompile(`nats://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)`)
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			s := m.statefulSets["nats"]
			if s == nil || s.Spec.Replicas == nil || *s.Spec.Replicas != 3 {
				t.Fatalf("NATS must be a StatefulSet of three: %+v", s)
			}
			h := m.services[s.Spec.ServiceName]
			if h == nil || h.Spec.ClusterIP != corev1.ClusterIPNone || !h.Spec.PublishNotReadyAddresses {
				t.Fatalf("StatefulSet nats: serviceName %q must be a headless Service publishing not-ready pods", s.Spec.ServiceName)
			}
			v := volume(&s.Spec.Template.Spec, "config")
			if v == nil || v.ConfigMap == nil || m.configMaps[v.ConfigMap.Name] == nil {
				t.Fatal("NATS mounts no ConfigMap config")
			}
			conf := m.configMaps[v.ConfigMap.Name].Data["nats.conf"]
			if !strings.Contains(conf, "jetstream {") || !strings.Contains(conf, "cluster {") {
				t.Errorf("nats.conf enables no JetStream cluster:\n%s", conf)
			}
			c := s.Spec.Template.Spec.Containers[0]
			if !slices.Contains(c.Args, "/etc/nats/nats.conf") {
				t.Errorf("nats runs %v, not its configuration", c.Args)
			}
			seen := map[int]bool{}
			for _, r := range route.FindAllStringSubmatch(conf, -1) {
				i, _ := strconv.Atoi(r[2])
				port, _ := strconv.Atoi(r[4])
				cp, ok := containerPort(c.Ports, intstr.FromString("cluster"))
				if r[1] != s.Name || r[3] != h.Name || i >= 3 || !ok || int(cp) != port {
					t.Errorf("route %s is not a server of StatefulSet %s through %s on its cluster port", r[0], s.Name, h.Name)
				}
				seen[i] = true
			}
			if len(seen) != 3 {
				t.Errorf("nats.conf routes to servers %v, want all three", seen)
			}
			if len(s.Spec.VolumeClaimTemplates) != 1 {
				t.Error("JetStream needs a volume per server")
			}
		})
	}
}

// TestPgBouncer checks PgBouncer pools in transaction mode from the Secret
// with the external PostgreSQL's URL.
func TestPgBouncer(t *testing.T) {
	for o, m := range renderAll(t) {
		t.Run(o, func(t *testing.T) {
			d := m.deployments["pgbouncer"]
			if d == nil || m.services["pgbouncer"] == nil {
				t.Fatal("no pgbouncer Deployment and Service")
			}
			env := map[string]corev1.EnvVar{}
			for _, e := range d.Spec.Template.Spec.Containers[0].Env {
				env[e.Name] = e
			}
			if env["POOL_MODE"].Value != "transaction" {
				t.Errorf("PgBouncer POOL_MODE %q, want transaction", env["POOL_MODE"].Value)
			}
			// The processes' idle_in_transaction_session_timeout is not
			// sent through PgBouncer; its own timeout must stand in.
			if v, err := strconv.Atoi(env["IDLE_TRANSACTION_TIMEOUT"].Value); err != nil || v <= 0 || v > 3600 {
				t.Errorf("PgBouncer IDLE_TRANSACTION_TIMEOUT %q, want 1–3600 seconds", env["IDLE_TRANSACTION_TIMEOUT"].Value)
			}
			if u := env["DATABASE_URL"].ValueFrom; u == nil || u.SecretKeyRef == nil || u.SecretKeyRef.Name != "bc-postgres" {
				t.Error("PgBouncer's DATABASE_URL must come from the Secret bc-postgres")
			}
			u := secretValues["bc-database/url"]
			if !strings.Contains(u, "@pgbouncer:5432/") {
				t.Errorf("the test's database URL %q does not go through PgBouncer", u)
			}
		})
	}
}
