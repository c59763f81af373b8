//go:build linux

package main

// Socket reads and writes as raw system calls (Linux only: elsewhere rawio_other.go gives Go's
// own calls, the fallback a measurement would take if these stopped paying:
// docs/benchmarks.md). Go's own (syscall.Syscall) enter and leave the
// scheduler around every call, and entering wakes the runtime's monitor thread (sysmon) when
// it sleeps; sysmon sleeps whenever the process idles for a moment, which a proxy below full
// load does between bursts, and once woken it ticks every 20 µs for a millisecond. A profile of
// the data plane serving streams at 75% of a core had a fifth of its CPU in that monitor
// (waking it, its 20 µs sleeps, the context switches they force). The sockets are
// non-blocking, so a raw call never blocks: it returns EAGAIN, and the goroutine waits in
// Go's network poller as before (deadlines included), through syscall.RawConn.

import (
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawConn is a TCP connection whose Read, Write and writev are raw system calls; everything
// else (deadlines, CloseWrite, addresses) is the TCP connection's own.
type rawConn struct {
	*net.TCPConn
	raw syscall.RawConn
	// beforeWait runs when a Read finds the socket empty, before the goroutine waits for more
	// (whileWaiting): set and called by the reading goroutine alone.
	beforeWait func()
}

// newRawConn wraps a TCP connection; any other connection is returned as it is.
func newRawConn(conn net.Conn) net.Conn {
	tcp, ok := conn.(*net.TCPConn)
	if !ok || raceBuild {
		return conn
	}
	raw, err := tcp.SyscallConn()
	if err != nil {
		return conn
	}
	return &rawConn{TCPConn: tcp, raw: raw}
}

func (c *rawConn) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	op := rawOps.Get().(*rawOp)
	op.into, op.beforeWait = b, c.beforeWait
	err := c.raw.Read(op.readFn)
	n, errno := op.n, op.errno
	op.clear()
	rawOps.Put(op)
	switch {
	case err != nil: // closed, or a deadline passed: already a *net.OpError
		return 0, err
	case errno != 0:
		return 0, c.failed("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (c *rawConn) Write(b []byte) (int, error) { return c.send(b, nil) }

// writeBoth writes head then body in one writev where the socket takes them.
func (c *rawConn) writeBoth(head, body []byte) error {
	_, err := c.send(head, body)
	return err
}

// send writes head then body (either may be empty) with writev, waiting in the poller when the
// socket's buffer is full; it returns how many bytes went.
func (c *rawConn) send(head, body []byte) (int, error) {
	op := rawOps.Get().(*rawOp)
	op.head, op.body = head, body
	err := c.raw.Write(op.writeFn)
	done, errno := op.n, op.errno
	op.clear()
	rawOps.Put(op)
	if err == nil && errno != 0 {
		err = c.failed("write", errno)
	}
	return done, err
}

// rawOp is one Read's or send's state, with the functions the poller calls bound to it once:
// a closure per call would be an allocation per read and write (a tenth of the data plane's
// allocated bytes serving small requests).
type rawOp struct {
	into, head, body []byte
	n                int
	errno            syscall.Errno
	readFn, writeFn  func(fd uintptr) bool
	beforeWait       func()
}

var rawOps = sync.Pool{New: func() any {
	op := &rawOp{}
	op.readFn, op.writeFn = op.read, op.write
	return op
}}

func (op *rawOp) clear() {
	op.into, op.head, op.body, op.n, op.errno, op.beforeWait = nil, nil, nil, 0, 0, nil
}

// read is one read(2), retried on EINTR; false (EAGAIN) sends the goroutine to the poller,
// after beforeWait. Bytes arriving between the EAGAIN and the wait are not missed: the
// poller's readiness is reset only when a Read starts, not between its tries.
func (op *rawOp) read(fd uintptr) bool {
	for {
		n, _, errno := syscall.RawSyscall(syscall.SYS_READ, fd,
			uintptr(unsafe.Pointer(&op.into[0])), uintptr(len(op.into)))
		if errno == syscall.EINTR {
			continue
		}
		op.n, op.errno = int(n), errno
		if errno != syscall.EAGAIN {
			return true
		}
		if op.beforeWait != nil {
			op.beforeWait()
		}
		return false
	}
}

// whileWaiting makes every Read of conn that would wait for its peer call f first, until
// whileWaiting(conn, nil); false when conn is not a raw connection (f is never called).
func whileWaiting(conn net.Conn, f func()) bool {
	c, ok := conn.(*rawConn)
	if ok {
		c.beforeWait = f
	}
	return ok
}

// write is writev(2) of what is left of head and body, until all went (true), the socket's
// buffer is full (false: wait until it drains) or it failed (true, op.errno set).
func (op *rawOp) write(fd uintptr) bool {
	head, body := op.head, op.body
	for total := len(head) + len(body); op.n < total; {
		var vectors [2]syscall.Iovec
		count := 0
		if op.n < len(head) {
			vectors[count].Base = &head[op.n]
			vectors[count].SetLen(len(head) - op.n)
			count++
		}
		if len(body) > 0 {
			from := max(op.n-len(head), 0)
			vectors[count].Base = &body[from]
			vectors[count].SetLen(len(body) - from)
			count++
		}
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd,
			uintptr(unsafe.Pointer(&vectors[0])), uintptr(count))
		switch e {
		case 0:
			op.n += int(n)
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			op.errno = e
			return true
		}
	}
	return true
}

// peerClosed: whether the peer of an idle connection closed it (or sent something nobody asked
// for, which makes it as unusable): one non-blocking peek that consumes nothing. It runs before
// every reuse of an engine connection, so it allocates nothing (a raw connection's syscall
// handle and the peek's state are kept, not made per call).
func peerClosed(conn net.Conn) bool {
	var raw syscall.RawConn
	if c, ok := conn.(*rawConn); ok {
		raw = c.raw
	} else if withFd, ok := conn.(syscall.Conn); ok {
		var err error
		if raw, err = withFd.SyscallConn(); err != nil {
			return true
		}
	} else {
		return false
	}
	op := peekOps.Get().(*peekOp)
	defer peekOps.Put(op)
	if err := raw.Read(op.peekFn); err != nil {
		return true
	}
	return op.errno != syscall.EAGAIN
}

// peekOp is one peerClosed's state, its function for the poller bound to it once.
type peekOp struct {
	one    [1]byte
	errno  syscall.Errno
	peekFn func(fd uintptr) bool
}

var peekOps = sync.Pool{New: func() any {
	op := &peekOp{}
	op.peekFn = op.peek
	return op
}}

func (op *peekOp) peek(fd uintptr) bool {
	for {
		_, _, op.errno = syscall.RawSyscall6(syscall.SYS_RECVFROM, fd,
			uintptr(unsafe.Pointer(&op.one[0])), 1, syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
		if op.errno != syscall.EINTR {
			return true // never wait: an open, idle connection has nothing to read
		}
	}
}

// failed is the error net's own connection gives for a failed system call, so callers'
// errors.Is (ECONNRESET, EPIPE) and net.Error checks read it the same.
func (c *rawConn) failed(op string, errno syscall.Errno) error {
	return &net.OpError{Op: op, Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(),
		Err: os.NewSyscallError(op, errno)}
}

// rawListener hands out rawConns.
type rawListener struct{ net.Listener }

func (l rawListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newRawConn(conn), nil
}

// writeHeadAndBody writes a request in one system call where it can.
func writeHeadAndBody(conn net.Conn, head, body []byte) error {
	if raw, ok := conn.(*rawConn); ok {
		return raw.writeBoth(head, body)
	}
	buffers := net.Buffers{head, body}
	_, err := buffers.WriteTo(conn)
	return err
}
