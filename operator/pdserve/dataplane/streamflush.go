package main

// A relayed stream's writes reach the client when the engine has nothing more to give right
// now, not after each read: the events that arrive while the last ones are being written go
// out in one write (one system call) instead of one each. No event waits for a later one: the
// flush runs the moment a read finds the engine's socket empty, before it waits there.

import "net/http"

// maxUnflushedWrites bounds how many writes an engine that never pauses can hold back.
const maxUnflushedWrites = 16

type idleFlush struct {
	flusher http.Flusher
	// Whether reads of the engine's connection flush first when they would wait; false (not
	// a raw connection: rawio_linux.go) flushes after every write.
	onWait  bool
	pending int // writes not flushed yet
}

// flushWhenIdle flushes what is written to w whenever a read of response would wait. The hook
// stays on the connection until the answer gives it back (upBody.finish).
func flushWhenIdle(w http.ResponseWriter, response *upBody) *idleFlush {
	f := &idleFlush{}
	f.flusher, _ = w.(http.Flusher)
	if f.flusher != nil {
		f.onWait = whileWaiting(response.conn.tcp, f.flush)
	}
	return f
}

// written: a write to the client that is to reach it.
func (f *idleFlush) written() {
	f.pending++
	if !f.onWait || f.pending >= maxUnflushedWrites {
		f.flush()
	}
}

func (f *idleFlush) flush() {
	if f.pending > 0 && f.flusher != nil {
		f.pending = 0
		f.flusher.Flush()
	}
}
