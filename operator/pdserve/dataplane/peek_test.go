//go:build unix

package main

import (
	"net"
	"testing"
)

// The portable check other systems than Linux run before reusing an engine connection, and
// Linux's raw one, judge the same connections alike.
func TestAnIdleConnectionIsReusableAndAClosedOrWrittenOneIsNot(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	pair := func() (ours, peer net.Conn) {
		accepted := make(chan net.Conn, 1)
		go func() {
			conn, _ := listener.Accept()
			accepted <- conn
		}()
		ours, err := net.Dial("tcp", listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		peer = <-accepted
		t.Cleanup(func() { ours.Close(); peer.Close() })
		return ours, peer
	}
	for name, check := range map[string]func(net.Conn) bool{
		"portable": peekClosed, "this system's": func(c net.Conn) bool { return peerClosed(newRawConn(c)) },
	} {
		idle, _ := pair()
		for range 2 { // and the check consumed nothing
			if check(idle) {
				t.Fatalf("%s check: an idle open connection reads as closed", name)
			}
		}
		written, peer := pair()
		peer.Write([]byte("x"))
		if !eventuallyTrue(func() bool { return check(written) }) {
			t.Fatalf("%s check: bytes nobody asked for were not seen", name)
		}
		closed, peer := pair()
		peer.Close()
		if !eventuallyTrue(func() bool { return check(closed) }) {
			t.Fatalf("%s check: the peer's close was not seen", name)
		}
	}
}

// eventuallyTrue: the condition holds once the peer's byte or close has reached our socket,
// which on loopback it has within the time a few thousand non-blocking checks take.
func eventuallyTrue(condition func() bool) bool {
	for i := 0; i < 100000; i++ {
		if condition() {
			return true
		}
	}
	return false
}
