//go:build unix

package main

import (
	"errors"
	"net"
	"syscall"
)

// peekClosed: whether the peer of an idle connection closed it (or sent something nobody asked
// for, which makes it as unusable): one non-blocking peek that consumes nothing. Portable over
// Unix systems, but it allocates per call, so Linux peeks with a raw recv instead (rawio_linux.go
// peerClosed, which runs before every reuse of an engine connection).
func peekClosed(conn net.Conn) bool {
	withFd, ok := conn.(syscall.Conn)
	if !ok {
		return false
	}
	raw, err := withFd.SyscallConn()
	if err != nil {
		return true
	}
	closed := true
	var one [1]byte
	if err := raw.Read(func(fd uintptr) bool {
		for {
			n, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			if errors.Is(err, syscall.EINTR) {
				continue
			}
			closed = !errors.Is(err, syscall.EAGAIN) || n > 0
			return true // never wait: an open, idle connection has nothing to read
		}
	}); err != nil {
		return true
	}
	return closed
}
