package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func engine(t *testing.T, handler http.HandlerFunc) (endpointURL, *atomic.Int64) {
	t.Helper()
	var opened atomic.Int64
	server := httptest.NewUnstartedServer(handler)
	server.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			opened.Add(1)
		}
	}
	server.Start()
	t.Cleanup(server.Close)
	at, err := parseEndpoint(server.URL)
	if err != nil {
		t.Fatal(err)
	}
	return at, &opened
}

func read(t *testing.T, response *http.Response) string {
	t.Helper()
	text, err := io.ReadAll(response.Body)
	if err != nil {
		t.Fatal(err)
	}
	response.Body.Close()
	return string(text)
}

func TestAnswersAreReadAndTheConnectionReused(t *testing.T) {
	at, opened := engine(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/v1/stream" {
			for i := range 3 { // chunked, flushed event by event
				fmt.Fprintf(w, "data: %d\n\n", i)
				w.(http.Flusher).Flush()
			}
			return
		}
		fmt.Fprintf(w, "%s %s %s %s", r.Header.Get("X-Request-Id"), r.Header.Get("Authorization"),
			r.Header.Get("Content-Type"), body)
	})
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	for i := range 3 {
		response, err := pool.post(context.Background(), at, "/v1/chat", []byte(`{"a":1}`), "id-1", "Bearer k")
		if err != nil {
			t.Fatal(err)
		}
		if got := read(t, response); got != `id-1 Bearer k application/json {"a":1}` {
			t.Fatalf("request %d: engine saw %q", i, got)
		}
	}
	response, err := pool.post(context.Background(), at, "/v1/stream", nil, "id-2", "")
	if err != nil {
		t.Fatal(err)
	}
	if got := read(t, response); got != "data: 0\n\ndata: 1\n\ndata: 2\n\n" {
		t.Fatalf("stream: %q", got)
	}
	if opened.Load() != 1 {
		t.Fatalf("%d connections opened for 4 requests, want 1", opened.Load())
	}
}

func TestAnAnswerNotReadToItsEndClosesItsConnection(t *testing.T) {
	at, opened := engine(t, func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, strings.Repeat("x", 100000))
	})
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	for range 2 {
		response, err := pool.post(context.Background(), at, "/", nil, "id", "")
		if err != nil {
			t.Fatal(err)
		}
		response.Body.Close() // a client that left mid-answer
	}
	if opened.Load() != 2 {
		t.Fatalf("%d connections, want 2: a half-read connection is never reused", opened.Load())
	}
}

// An engine that answers one request per connection and then closes it, the way an engine
// closes an idle kept-alive connection: the next request on it must go to a new connection.
func TestAConnectionTheEngineClosedWhileIdleIsRetriedOnANewOne(t *testing.T) {
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { listener.Close() })
	var accepted atomic.Int64
	go func() {
		for {
			conn, err := listener.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			go func() {
				defer conn.Close()
				request, err := http.ReadRequest(bufio.NewReader(conn))
				if err != nil {
					return
				}
				io.Copy(io.Discard, request.Body)
				fmt.Fprint(conn, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
			}()
		}
	}()
	at, _ := parseEndpoint("http://" + listener.Addr().String())
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	for i := range 3 {
		response, err := pool.post(context.Background(), at, "/", []byte("{}"), "id", "")
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if got := read(t, response); got != "ok" {
			t.Fatalf("request %d: %q", i, got)
		}
	}
	if accepted.Load() != 3 {
		t.Fatalf("%d connections, want 3", accepted.Load())
	}
}

func TestAnEngineSilentPastTheFirstByteTimeoutFails(t *testing.T) {
	release := make(chan struct{})
	at, _ := engine(t, func(http.ResponseWriter, *http.Request) { <-release })
	defer close(release)
	pool := newUpstreamPool(time.Second, 50*time.Millisecond, time.Minute)
	begun := time.Now()
	_, err := pool.post(context.Background(), at, "/", nil, "id", "")
	var timeout net.Error
	if !errors.As(err, &timeout) || !timeout.Timeout() {
		t.Fatalf("error %v, want a timeout", err)
	}
	if waited := time.Since(begun); waited > 5*time.Second {
		t.Fatalf("waited %v", waited)
	}
}

func TestTheRequestsContextEndingStopsTheExchange(t *testing.T) {
	release := make(chan struct{})
	at, _ := engine(t, func(http.ResponseWriter, *http.Request) { <-release })
	defer close(release)
	pool := newUpstreamPool(time.Second, time.Minute, time.Minute)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := pool.post(ctx, at, "/", nil, "id", ""); !errors.Is(err, context.Canceled) {
		t.Fatalf("error %v, want the context's", err)
	}
}

func TestOnlyPlainHTTPEnginesAreAccepted(t *testing.T) {
	for raw, want := range map[string]string{
		"http://10.0.0.1:8000":     "10.0.0.1:8000",
		"http://engine/":           "engine:80",
		"http://[fd00::1]:8000/v1": "[fd00::1]:8000",
	} {
		at, err := parseEndpoint(raw)
		if err != nil || at.host != want {
			t.Errorf("%s: %+v %v, want host %s", raw, at, err, want)
		}
	}
	for _, raw := range []string{"https://engine:8443", "engine:8000", "http://"} {
		if _, err := parseEndpoint(raw); err == nil {
			t.Errorf("%s was accepted", raw)
		}
	}
}
