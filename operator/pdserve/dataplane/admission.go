package main

// The admission channel: one kept-open loopback connection to the Python gateway, opened at
// start and again whenever it closes, on which both sides ask each other for long-prefill slots
// in lines (the protocol: pdserve/gateway/dataplane_admission.py). The asker's ids are its own:
//
//	data plane -> gateway  hello <token>                  (first, once per connection)
//	either -> the other    acquire <id> <url> [<url>...]  (prefill replicas, best first)
//	the other -> asker     granted <id> <url>
//	asker -> the other     release <id>
//
// The Python gateway asks this replica's queue (fairqueue.go) for its own long requests and its
// peers'; the data plane asks the Python gateway only while another gateway replica is the
// admission leader (the Python gateway then holds the slot through the leader).

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
	queue          *fairQueue
	holdFor        time.Duration // at most this long a slot is held for the Python gateway
	next           atomic.Uint64
	mu             sync.Mutex // guards conn, waiters, holds and every write
	conn           net.Conn
	waiters        map[string]chan string        // the data plane's asks, by its ids
	holds          map[string]context.CancelFunc // the Python gateway's asks, by its ids
}

var errAdmissionClosed = errors.New("the admission connection closed")

func newAdmissionChannel(address, token string, queue *fairQueue, holdFor time.Duration) *admissionChannel {
	return &admissionChannel{address: address, token: token, queue: queue, holdFor: holdFor,
		waiters: map[string]chan string{}, holds: map[string]context.CancelFunc{}}
}

// keepConnected connects, serves the connection until it closes, and connects again (the
// Python gateway listens before it starts the data plane; it may stop before the data plane).
func (a *admissionChannel) keepConnected(retry time.Duration) {
	for {
		conn, err := net.DialTimeout("tcp", a.address, 5*time.Second)
		if err == nil {
			a.mu.Lock()
			a.conn = conn
			err = a.send("hello " + a.token)
			a.mu.Unlock()
			if err == nil {
				a.read(conn)
			}
		}
		time.Sleep(retry) // a pause between attempts, not synchronization
	}
}

// acquire asks the Python gateway for a slot on one of `replicas` (best first) and returns it
// with the function that gives it back.
func (a *admissionChannel) acquire(ctx context.Context, replicas []string) (string, func(), error) {
	id := strconv.FormatUint(a.next.Add(1), 36)
	granted := make(chan string, 1)
	a.mu.Lock()
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
		if len(fields) < 2 {
			continue
		}
		id := fields[1]
		a.mu.Lock()
		switch {
		case fields[0] == "granted" && len(fields) == 3:
			select {
			case a.waiters[id] <- fields[2]: // buffered; a nil channel (no such ask) is never ready
			default: // a second grant for one ask: the first stands
			}
		case fields[0] == "acquire" && len(fields) >= 3 && a.holds[id] == nil:
			ctx, cancel := context.WithTimeout(context.Background(), a.holdFor)
			a.holds[id] = cancel
			go a.hold(ctx, conn, id, a.queue.enqueue(fields[2:]))
		case fields[0] == "release" && len(fields) == 2:
			if cancel := a.holds[id]; cancel != nil {
				delete(a.holds, id)
				cancel()
			}
		}
		a.mu.Unlock()
	}
	a.mu.Lock()
	a.drop(conn)
	a.mu.Unlock()
}

// hold waits in this replica's queue for the Python gateway's ask `id`, says when it is
// granted, and keeps the slot until released (or the connection closes, or holdFor passes).
func (a *admissionChannel) hold(ctx context.Context, conn net.Conn, id string, waiter *queuedPrompt) {
	url, release, err := a.queue.wait(ctx, waiter)
	if err != nil {
		return // released (or gone) while queued
	}
	defer release()
	a.mu.Lock()
	if ctx.Err() == nil && a.conn == conn {
		_ = a.send("granted " + id + " " + url)
	}
	a.mu.Unlock()
	<-ctx.Done()
	a.mu.Lock()
	if a.holds[id] != nil && a.conn == conn { // held past holdFor: the Python gateway forgot it
		delete(a.holds, id)
	}
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
	for id, cancel := range a.holds {
		cancel()
		delete(a.holds, id)
	}
}
