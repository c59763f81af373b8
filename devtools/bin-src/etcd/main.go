// Command etcd runs the etcd server of the version that k8s.io/kubernetes pins, so the
// test control plane needs nothing outside the Go module proxy.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
