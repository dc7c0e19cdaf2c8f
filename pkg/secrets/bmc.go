package secrets

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
)

// Bounds of BMC credentials.
const (
	// MaxBMCUsernameLen bounds a BMC user name.
	MaxBMCUsernameLen = 256
	// MaxBMCPasswordLen bounds a BMC password.
	MaxBMCPasswordLen = 1024
)

// redacted stands for a password in every printed form.
const redacted = "[REDACTED]"

// BMCCredentials are a BMC's user name and password: the payload of a
// [KindBMC] secret, as JSON {"username", "password"}. Its String, GoString
// and LogValue never show the password; only its JSON encoding (what is
// sealed) holds it.
type BMCCredentials struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// Validate checks both fields are set and within bounds; errors name the
// field ("username", "password") and never the password.
func (c BMCCredentials) Validate() error {
	switch {
	case c.Username == "":
		return errors.New("username: required")
	case len(c.Username) > MaxBMCUsernameLen:
		return fmt.Errorf("username: at most %d bytes", MaxBMCUsernameLen)
	case c.Password == "":
		return errors.New("password: required")
	case len(c.Password) > MaxBMCPasswordLen:
		return fmt.Errorf("password: at most %d bytes", MaxBMCPasswordLen)
	}
	return nil
}

// Marshal returns the payload to seal.
func (c BMCCredentials) Marshal() []byte {
	b, _ := json.Marshal(c) // cannot fail: two strings
	return b
}

// ParseBMC reads the payload of a [KindBMC] secret.
func ParseBMC(b []byte) (BMCCredentials, error) {
	var c BMCCredentials
	if err := json.Unmarshal(b, &c); err != nil {
		return BMCCredentials{}, errors.New("bmc credentials: not a JSON object of username and password")
	}
	if err := c.Validate(); err != nil {
		return BMCCredentials{}, fmt.Errorf("bmc credentials: %w", err)
	}
	return c, nil
}

// String shows the user name only.
func (c BMCCredentials) String() string {
	return fmt.Sprintf("bmc credentials of user %q (password %s)", c.Username, redacted)
}

// GoString is String, so %#v redacts too.
func (c BMCCredentials) GoString() string { return c.String() }

// LogValue logs the user name and a redacted password.
func (c BMCCredentials) LogValue() slog.Value {
	return slog.GroupValue(slog.String("username", c.Username), slog.String("password", redacted))
}

// Format redacts under every verb (%v, %+v, %s, %q, %x …).
func (c BMCCredentials) Format(f fmt.State, verb rune) {
	switch verb {
	case 'q':
		fmt.Fprintf(f, "%q", c.String())
	default:
		fmt.Fprint(f, c.String())
	}
}
