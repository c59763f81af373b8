//go:build race

package main

// The race detector learns that one goroutine's write happens before another's read of the
// same bytes from annotations in Go's own socket calls, which raw calls skip: race builds use
// Go's calls (plain `go test` runs the raw ones).
const raceBuild = true
