// Command coredns is CoreDNS with only the plugins the real node's cluster DNS uses (bind, errors,
// cache, kubernetes): a much smaller build than the full plugin set. The directive order still
// comes from CoreDNS's own core/dnsserver.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func main() {
	coremain.Run()
}
