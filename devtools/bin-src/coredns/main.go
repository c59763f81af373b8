// CoreDNS for the local real node, with only the plugins it needs: names under cluster.local
// answered from the API server (the kubernetes plugin), nothing forwarded anywhere, so a pod's
// lookup never leaves the machine. Built by ../build.sh.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The Corefile may use these directives only, in CoreDNS's own order (plugin.cfg).
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "kubernetes"}
}

func main() {
	coremain.Run()
}
