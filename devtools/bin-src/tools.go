//go:build tools

// Package binsrc pins the Kubernetes commands that build.sh compiles, so `go mod tidy`
// keeps them in go.mod and go.sum.
package binsrc

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
