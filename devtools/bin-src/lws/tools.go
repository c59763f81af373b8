//go:build tools

// Package tools pins the LeaderWorkerSet manager's main package (sigs.k8s.io/lws/cmd) as a
// dependency of this module, so `go build sigs.k8s.io/lws/cmd` resolves it from go.mod/go.sum.
package tools

import _ "sigs.k8s.io/lws/cmd"
