package main

// Long prompts' fair prefill admission, which the Python gateway runs (with its peer
// replicas): a slot is asked for and given back as lines on one kept-open loopback connection
// (the protocol: pdserve/gateway/dataplane_admission.py), so a long prompt costs the Python
// gateway two short lines, not an HTTP request held open while prefill runs.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

type admissionChannel struct {
	address, token string
	next           atomic.Uint64
	mu             sync.Mutex // guards conn, waiters and every write
	conn           net.Conn
	waiters        map[string]chan string
}

var errAdmissionClosed = errors.New("the admission connection closed")

func newAdmissionChannel(address, token string) *admissionChannel {
	return &admissionChannel{address: address, token: token, waiters: map[string]chan string{}}
}

// acquire waits for a slot on one of `replicas` (best first) and returns it with the function
// that gives it back.
func (a *admissionChannel) acquire(ctx context.Context, replicas []string) (string, func(), error) {
	id := strconv.FormatUint(a.next.Add(1), 36)
	granted := make(chan string, 1)
	a.mu.Lock()
	if err := a.connect(); err != nil {
		a.mu.Unlock()
		return "", nil, err
	}
	a.waiters[id] = granted
	err := a.send("acquire " + id + " " + strings.Join(replicas, " "))
	a.mu.Unlock()
	if err != nil {
		return "", nil, err
	}
	release := func() {
		a.mu.Lock()
		defer a.mu.Unlock()
		delete(a.waiters, id)
		_ = a.send("release " + id)
	}
	select {
	case url, ok := <-granted:
		if !ok {
			return "", nil, errAdmissionClosed // the Python gateway let its slots go with it
		}
		return url, release, nil
	case <-ctx.Done():
		release() // granted meanwhile or not: the Python gateway gives it back either way
		return "", nil, ctx.Err()
	}
}

// connect (with a.mu held) opens the connection when there is none.
func (a *admissionChannel) connect() error {
	if a.conn != nil {
		return nil
	}
	if a.address == "" {
		return errors.New("no admission address (-admission)")
	}
	conn, err := net.DialTimeout("tcp", a.address, 5*time.Second)
	if err != nil {
		return err
	}
	a.conn = conn
	if err := a.send("hello " + a.token); err != nil {
		return err
	}
	go a.read(conn)
	return nil
}

// send (with a.mu held) writes one line; a failed write closes the connection.
func (a *admissionChannel) send(line string) error {
	if a.conn == nil {
		return errAdmissionClosed
	}
	if _, err := fmt.Fprintf(a.conn, "%s\n", line); err != nil {
		a.drop(a.conn)
		return err
	}
	return nil
}

func (a *admissionChannel) read(conn net.Conn) {
	lines := bufio.NewScanner(conn)
	for lines.Scan() {
		fields := strings.Fields(lines.Text())
		if len(fields) != 3 || fields[0] != "granted" {
			continue
		}
		a.mu.Lock()
		if waiter := a.waiters[fields[1]]; waiter != nil {
			waiter <- fields[2]
		}
		a.mu.Unlock()
	}
	a.mu.Lock()
	a.drop(conn)
	a.mu.Unlock()
}

// drop (with a.mu held): the connection is gone, and so is every slot asked for on it.
func (a *admissionChannel) drop(conn net.Conn) {
	if a.conn != conn {
		return
	}
	conn.Close()
	a.conn = nil
	for id, waiter := range a.waiters {
		close(waiter)
		delete(a.waiters, id)
	}
}
