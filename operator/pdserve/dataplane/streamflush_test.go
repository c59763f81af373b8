package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Events are held back only while more can be read at once: an engine that sends one and
// waits until the client has it (a decode step at a time) gets each through on its own.
// Under the race detector the engine connections are Go's own, flushed after every write;
// plain `go test` runs the raw ones, which flush when a read would wait (streamflush.go).
func TestEachEventReachesTheClientBeforeTheEngineSendsTheNext(t *testing.T) {
	const events = 5
	received := make(chan struct{})
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range events {
			finish := "null"
			if i == events-1 {
				finish = `"length"`
			}
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"t%d\"},\"finish_reason\":%s}]}\n\n", i, finish)
			w.(http.Flusher).Flush()
			select {
			case <-received:
			case <-r.Context().Done():
				return
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	}, nil)
	response := u.opened(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	lines := make(chan string)
	go func() {
		reader := bufio.NewReader(response.Body)
		for {
			line, err := reader.ReadString('\n')
			if err != nil {
				close(lines)
				return
			}
			if strings.HasPrefix(line, "data: ") {
				lines <- strings.TrimSpace(line)
			}
		}
	}()
	for i := range events {
		select {
		case line := <-lines:
			if !strings.Contains(line, fmt.Sprintf(`"t%d"`, i)) {
				t.Fatalf("event %d: %q", i, line)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("event %d was held back: the engine waits for the client to have it", i)
		}
		received <- struct{}{}
	}
	if last := <-lines; last != "data: [DONE]" {
		t.Fatalf("after the events: %q", last)
	}
}
