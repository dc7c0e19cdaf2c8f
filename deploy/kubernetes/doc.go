// Package kubernetes holds the Better Compute Kubernetes manifests (a
// kustomize base and the overlays dev and ha) and their test, which renders
// each overlay with kustomize's Go API, decodes every object strictly into the
// Kubernetes API types and checks it against the control plane's own roles and
// configuration (pkg/config). It is a module of its own so that kustomize and
// the Kubernetes API types stay out of the services' dependencies.
package kubernetes
