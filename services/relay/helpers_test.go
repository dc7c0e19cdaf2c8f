package relay_test

import (
	"net"
	"net/url"
)

// listenOn listens on the host:port of rawURL again.
func listenOn(rawURL string) (net.Listener, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, err
	}
	return net.Listen("tcp", u.Host)
}
