package cli

import (
	"bytes"
	"errors"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/bettercompute/bettercompute/pkg/fault"
)

// clientConfig is where the api command sends its calls and with which
// credential.
type clientConfig struct {
	URL   string `yaml:"url"`
	Token string `yaml:"token"`
}

// clientFile is the client config file: one `client:` section.
type clientFile struct {
	Client clientConfig `yaml:"client"`
}

// resolveClient resolves the URL and token: the flag, else the environment,
// else the client config file, else (URL only) DefaultURL.
func resolveClient(f *apiFlags, getenv func(string) string) (clientConfig, error) {
	file, path, err := readClientFile(f.clientConfig, getenv)
	if err != nil {
		return clientConfig{}, err
	}
	pick := func(flagName, flagVal, env, fileVal, def string) (string, string) {
		switch {
		case flagVal != "":
			return flagVal, "--" + flagName
		case getenv(env) != "":
			return getenv(env), env
		case fileVal != "":
			return fileVal, path
		}
		return def, "the default"
	}
	var cc clientConfig
	var from string
	cc.URL, from = pick("url", f.url, EnvURL, file.URL, DefaultURL)
	cc.Token, _ = pick("token", f.token, EnvToken, file.Token, "")
	u, err := url.Parse(cc.URL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return clientConfig{}, fault.New(fault.InvalidConfig, "client.url",
			"expected an http:// or https:// base URL such as %s, got %q (from %s)", DefaultURL, cc.URL, from)
	}
	if strings.ContainsFunc(cc.Token, func(r rune) bool { return r < 0x21 || r == 0x7f }) {
		return clientConfig{}, fault.New(fault.InvalidConfig, "client.token", "the token contains a space or control character")
	}
	return cc, nil
}

// readClientFile reads the client config file: --client-config, else
// $BETTER_COMPUTE_CONFIG (either must exist), else
// $XDG_CONFIG_HOME/better-compute/client.yaml or
// ~/.config/better-compute/client.yaml when present.
func readClientFile(flagPath string, getenv func(string) string) (clientConfig, string, error) {
	path, explicit := flagPath, true
	if path == "" {
		path = getenv(EnvClientConfig)
	}
	if path == "" {
		explicit = false
		path = defaultClientConfigPath(getenv)
		if path == "" {
			return clientConfig{}, "", nil
		}
	}
	b, err := os.ReadFile(path)
	if err != nil {
		if !explicit && errors.Is(err, os.ErrNotExist) {
			return clientConfig{}, "", nil
		}
		return clientConfig{}, "", fault.Wrap(err, fault.InvalidConfig, "client", "cannot read the client config file: %v", err)
	}
	var cf clientFile
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&cf); err != nil && !errors.Is(err, io.EOF) {
		return clientConfig{}, "", fault.Wrap(err, fault.InvalidConfig, "client", "%s: %v", path, err)
	}
	return cf.Client, path, nil
}

func defaultClientConfigPath(getenv func(string) string) string {
	dir := getenv("XDG_CONFIG_HOME")
	if dir == "" {
		home := getenv("HOME")
		if home == "" {
			if h, err := os.UserHomeDir(); err == nil {
				home = h
			}
		}
		if home == "" {
			return ""
		}
		dir = filepath.Join(home, ".config")
	}
	return filepath.Join(dir, "better-compute", "client.yaml")
}
