package webhooks

import "github.com/bettercompute/bettercompute/pkg/outbound"

// CheckEndpoint validates a webhook's endpoint URL under o, the webhooks'
// outbound rules (pkg/outbound, where the rules and the client that
// delivers live): an INVALID_INPUT fault on field "url".
func CheckEndpoint(raw string, o outbound.Options) error {
	return outbound.CheckURL(raw, "url", o)
}
