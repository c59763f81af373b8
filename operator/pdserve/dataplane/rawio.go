package main

// Socket reads and writes as raw system calls. Go's own (syscall.Syscall) enter and leave the
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
	"syscall"
	"unsafe"
)

// rawConn is a TCP connection whose Read, Write and writev are raw system calls; everything
// else (deadlines, CloseWrite, addresses) is the TCP connection's own.
type rawConn struct {
	*net.TCPConn
	raw syscall.RawConn
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
	var n uintptr
	var errno syscall.Errno
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			n, _, errno = syscall.RawSyscall(syscall.SYS_READ, fd,
				uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)))
			if errno != syscall.EINTR {
				return errno != syscall.EAGAIN
			}
		}
	})
	switch {
	case err != nil: // closed, or a deadline passed: already a *net.OpError
		return 0, err
	case errno != 0:
		return 0, c.failed("read", errno)
	case n == 0:
		return 0, io.EOF
	}
	return int(n), nil
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
	done, total := 0, len(head)+len(body)
	var errno syscall.Errno
	err := c.raw.Write(func(fd uintptr) bool {
		for done < total {
			var vectors [2]syscall.Iovec
			count := 0
			if done < len(head) {
				vectors[count].Base = &head[done]
				vectors[count].SetLen(len(head) - done)
				count++
			}
			if len(body) > 0 {
				from := max(done-len(head), 0)
				vectors[count].Base = &body[from]
				vectors[count].SetLen(len(body) - from)
				count++
			}
			n, _, e := syscall.RawSyscall(syscall.SYS_WRITEV, fd,
				uintptr(unsafe.Pointer(&vectors[0])), uintptr(count))
			switch e {
			case 0:
				done += int(n)
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false // the socket's buffer is full: wait until it drains
			default:
				errno = e
				return true
			}
		}
		return true
	})
	if err == nil && errno != 0 {
		err = c.failed("write", errno)
	}
	return done, err
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
