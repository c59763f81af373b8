//go:build unix && !linux

package main

// Elsewhere than Linux the data plane uses Go's own socket calls (rawio_linux.go says why
// Linux's are raw): the same behaviour, without the system-call savings.

import "net"

func newRawConn(conn net.Conn) net.Conn { return conn }

// rawListener hands out the listener's connections as they are.
type rawListener struct{ net.Listener }

func peerClosed(conn net.Conn) bool { return peekClosed(conn) }

// whileWaiting: Go's own calls cannot run anything before they wait (rawio_linux.go).
func whileWaiting(net.Conn, func()) bool { return false }

func writeHeadAndBody(conn net.Conn, head, body []byte) error {
	buffers := net.Buffers{head, body}
	_, err := buffers.WriteTo(conn)
	return err
}
