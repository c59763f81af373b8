//go:build linux

package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// rawPair is a connected pair of TCP connections on loopback: ours wrapped in a rawConn (made
// directly, so race builds test it too), the peer's plain.
func rawPair(t *testing.T) (*rawConn, *net.TCPConn) {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		conn, _ := listener.Accept()
		accepted <- conn
	}()
	dialed, err := net.Dial("tcp", listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer := <-accepted
	if peer == nil {
		t.Fatal("accept failed")
	}
	tcp := dialed.(*net.TCPConn)
	raw, err := tcp.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dialed.Close(); peer.Close() })
	return &rawConn{TCPConn: tcp, raw: raw}, peer.(*net.TCPConn)
}

func TestARawConnectionCarriesMoreThanTheSocketBuffersHoldBothWays(t *testing.T) {
	ours, peer := rawPair(t)
	// 8 MiB does not fit in the socket buffers: writes meet EAGAIN and wait for the reader.
	sent := bytes.Repeat([]byte("0123456789abcdef"), 512*1024)
	received := make(chan []byte, 1)
	go func() {
		got, _ := io.ReadAll(peer)
		received <- got
	}()
	if n, err := ours.Write(sent); err != nil || n != len(sent) {
		t.Fatalf("Write: %d of %d bytes, %v", n, len(sent), err)
	}
	head := []byte("POST / HTTP/1.1\r\n\r\n")
	if err := writeHeadAndBody(ours, head, sent); err != nil {
		t.Fatalf("writev: %v", err)
	}
	ours.CloseWrite()
	if got := <-received; !bytes.Equal(got, append(append(append([]byte{}, sent...), head...), sent...)) {
		t.Fatalf("the peer read %d bytes, not the %d written in order", len(got), 2*len(sent)+len(head))
	}

	go func() {
		peer.Write(sent)
		peer.Close()
	}()
	got, err := io.ReadAll(ours)
	if err != nil || !bytes.Equal(got, sent) {
		t.Fatalf("ReadAll: %d of %d bytes, %v", len(got), len(sent), err)
	}
	if n, err := ours.Read(make([]byte, 16)); n != 0 || err != io.EOF {
		t.Fatalf("a read after the peer closed: %d, %v; want 0, io.EOF", n, err)
	}
}

func TestARawConnectionsReadKeepsItsDeadlineAndAResetReadsAsGosOwn(t *testing.T) {
	ours, peer := rawPair(t)
	ours.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, err := ours.Read(make([]byte, 16))
	var netErr net.Error
	if !errors.As(err, &netErr) || !netErr.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a read past its deadline: %v; want a net.Error that timed out", err)
	}
	ours.SetReadDeadline(time.Time{})

	peer.SetLinger(0) // closing sends a reset
	peer.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err = ours.Write([]byte("x"))
		if err != nil || time.Now().After(deadline) {
			break
		}
	}
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("writing to a reset connection: %v; want ECONNRESET or EPIPE", err)
	}
	var opErr *net.OpError
	if !errors.As(err, &opErr) || opErr.Op != "write" {
		t.Fatalf("the error %v is not a *net.OpError for write, as net's own connection gives", err)
	}
}

func TestTheClientListenerAndTheEnginesConnectionsAreRaw(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close()
	go func() {
		conn, _ := net.Dial("tcp", listener.Addr().String())
		if conn != nil {
			defer conn.Close()
		}
	}()
	conn, err := rawListener{listener}.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, raw := conn.(*rawConn)
	if raw == raceBuild { // race builds use Go's own socket calls (rawio_race.go)
		t.Fatalf("the listener handed out a %T in a build with raceBuild=%v", conn, raceBuild)
	}
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	at, err := parseEndpoint("http://" + listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	up, err := pool.get(context.Background(), at)
	if err != nil {
		t.Fatal(err)
	}
	defer up.conn.Close()
	if _, raw := up.conn.(*rawConn); raw == raceBuild {
		t.Fatalf("an engine's connection is a %T in a build with raceBuild=%v", up.conn, raceBuild)
	}
}

// Every small request is a few reads and writes: each allocating would feed the collector
// (a closure per call was a tenth of the data plane's allocated bytes).
func TestARawReadAndWriteAllocateNothing(t *testing.T) {
	ours, peer := rawPair(t)
	message := []byte("data: {\"token\":1}\n\n")
	into := make([]byte, 64)
	echo := make([]byte, len(message))
	allocations := testing.AllocsPerRun(200, func() {
		if _, err := ours.Write(message); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(peer, echo); err != nil {
			t.Fatal(err)
		}
		if _, err := peer.Write(echo); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(ours, into[:len(message)]); err != nil {
			t.Fatal(err)
		}
	})
	// Under the race detector sync.Pool drops a quarter of what it is given back on purpose,
	// about 1.5 allocations per run here; a closure per call is 2.
	limit := 0.0
	if raceBuild {
		limit = 1
	}
	if allocations > limit {
		t.Fatalf("a write and a read on a raw connection allocate %.1f times; want at most %.0f", allocations, limit)
	}
}

// A read that finds the socket empty runs the hook before it waits, and bytes that arrive
// between that empty read and the wait are read, not left until more come (a stream's last
// event would otherwise wait for the idle timeout).
func TestAReadThatWouldWaitRunsItsHookFirstAndMissesNothingSentMeanwhile(t *testing.T) {
	ours, peer := rawPair(t)
	calls := 0
	if !whileWaiting(ours, func() {
		calls++
		if calls == 1 {
			peer.Write([]byte("sent while the reader was about to wait"))
		}
	}) {
		t.Fatal("a raw connection took no hook")
	}
	ours.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 100)
	n, err := ours.Read(got)
	if err != nil || string(got[:n]) != "sent while the reader was about to wait" || calls != 1 {
		t.Fatalf("read %q, %v, hook ran %d times", got[:n], err, calls)
	}
	whileWaiting(ours, nil)
	go peer.Write([]byte("after")) // before or after this read waits: never the hook
	for read := ""; read != "after"; {
		if n, err = ours.Read(got); err != nil {
			t.Fatal(err)
		}
		read += string(got[:n])
	}
	if calls != 1 {
		t.Fatalf("the hook ran %d times after it was taken off", calls)
	}
	if whileWaiting(peer, func() {}) {
		t.Error("a connection that is not raw took a hook")
	}
}
