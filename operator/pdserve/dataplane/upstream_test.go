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
	"syscall"
	"testing"
	"time"
)

func engine(t testing.TB, handler http.HandlerFunc) (endpointURL, *atomic.Int64) {
	t.Helper()
	_, at, opened := engineServer(t, handler)
	return at, opened
}

// engineServer is engine with its server, for a test that closes the server's connections.
func engineServer(t testing.TB, handler http.HandlerFunc) (*httptest.Server, endpointURL, *atomic.Int64) {
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
	return server, at, &opened
}

func read(t *testing.T, response *upBody) string {
	t.Helper()
	text, err := io.ReadAll(response)
	if err != nil {
		t.Fatal(err)
	}
	response.Close()
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
		response.Close() // a client that left mid-answer
	}
	if opened.Load() != 2 {
		t.Fatalf("%d connections, want 2: a half-read connection is never reused", opened.Load())
	}
}

// An engine that answers one request per connection and then closes it, the way an engine
// closes an idle kept-alive connection: the next request on it must go to a new connection.
func TestAConnectionTheEngineClosedWhileIdleIsRetriedOnANewOne(t *testing.T) {
	once := scripted{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", true}
	at, accepted := scriptedEngine(t, once, once, once)
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

func TestOnlyHTTPAndHTTPSEnginesAreAccepted(t *testing.T) {
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
	for _, raw := range []string{"ftp://engine:8443", "engine:8000", "http://", "https://"} {
		if _, err := parseEndpoint(raw); err == nil {
			t.Errorf("%s was accepted", raw)
		}
	}
}

type scripted struct {
	answer string
	close  bool // the engine closes the connection after this answer
}

// scriptedEngine answers each request it reads with the next of its scripted answers, written
// as they are: the framings and heads net/http's server would never send.
func scriptedEngine(t *testing.T, answers ...scripted) (endpointURL, *atomic.Int64) {
	t.Helper()
	next := make(chan scripted, len(answers))
	for _, answer := range answers {
		next <- answer
	}
	close(next)
	return rawEngine(t, func(conn net.Conn) bool {
		answer, ok := <-next
		if !ok {
			return false
		}
		_, err := io.WriteString(conn, answer.answer)
		return err == nil && !answer.close
	})
}

// rawEngine reads requests on every connection it accepts and lets `answer` write what it
// likes for each, as it likes, until it answers false (the connection then closes); the
// connections it accepted are counted.
func rawEngine(t *testing.T, answer func(conn net.Conn) bool) (endpointURL, *atomic.Int64) {
	t.Helper()
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
				reader := bufio.NewReader(conn)
				for {
					request, err := http.ReadRequest(reader)
					if err != nil {
						return
					}
					io.Copy(io.Discard, request.Body)
					if !answer(conn) {
						return
					}
				}
			}()
		}
	}()
	at, _ := parseEndpoint("http://" + listener.Addr().String())
	return at, &accepted
}

func TestEveryFramingIsReadAndOnlyAWholeKeptAliveAnswerReusesItsConnection(t *testing.T) {
	for _, test := range []struct {
		name       string
		answer     scripted
		status     int
		body       string
		reused     bool
		truncation bool
	}{
		{"content length", scripted{answer: "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"},
			200, "hello", true, false},
		{"lowercase names, spaces around values", scripted{answer: "HTTP/1.1 200 OK\r\ncontent-length:   5 \r\nconnection: Keep-Alive\r\n\r\nhello"},
			200, "hello", true, false},
		{"chunked with extensions and a trailer", scripted{answer: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" +
			"3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\n"}, 200, "hello", true, false},
		{"an interim 100 first", scripted{answer: "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"},
			200, "ok", true, false},
		{"no content", scripted{answer: "HTTP/1.1 204 No Content\r\n\r\n"}, 204, "", true, false},
		{"an error status, its body kept", scripted{answer: "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"},
			503, "busy", true, false},
		{"Connection: close", scripted{answer: "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", close: true},
			200, "ok", false, false},
		{"HTTP/1.0, the body to the connection's close", scripted{answer: "HTTP/1.0 200 OK\r\n\r\nuntil close", close: true},
			200, "until close", false, false},
		{"a body cut short", scripted{answer: "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", close: true},
			200, "hello", false, true},
		{"a chunk cut short", scripted{answer: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", close: true},
			200, "hel", false, true},
	} {
		t.Run(test.name, func(t *testing.T) {
			at, accepted := scriptedEngine(t, test.answer,
				scripted{answer: "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"})
			pool := newUpstreamPool(time.Second, time.Second, time.Minute)
			answer, err := pool.post(context.Background(), at, "/", []byte("{}"), "id", "")
			if err != nil {
				t.Fatal(err)
			}
			body, err := io.ReadAll(answer)
			answer.Close()
			if answer.status != test.status || string(body) != test.body {
				t.Fatalf("status %d body %q, want %d %q", answer.status, body, test.status, test.body)
			}
			if test.truncation != errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("read error %v (truncated: %v)", err, test.truncation)
			}
			answer, err = pool.post(context.Background(), at, "/", []byte("{}"), "id", "")
			if err != nil {
				t.Fatal(err)
			}
			if got := read(t, answer); got != "next" {
				t.Fatalf("the next answer: %q", got)
			}
			if want := map[bool]int64{true: 1, false: 2}[test.reused]; accepted.Load() != want {
				t.Fatalf("%d connections, want %d", accepted.Load(), want)
			}
		})
	}
}

func TestAMalformedAnswerHeadIsAnErrorNamingIt(t *testing.T) {
	for name, head := range map[string]string{
		"status line":                          "HTTP/2 200 OK\r\n\r\n",
		"header line":                          "HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
		"obs-fold":                             "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n folded\r\n\r\nok",
		"Content-Length":                       "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
		"Transfer-Encoding other than chunked": "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
		"head line too long":                   "HTTP/1.1 200 OK\r\nX-Long: " + strings.Repeat("x", 20000) + "\r\n\r\n",
	} {
		t.Run(name, func(t *testing.T) {
			at, _ := scriptedEngine(t, scripted{answer: head, close: true})
			pool := newUpstreamPool(time.Second, time.Second, time.Minute)
			_, err := pool.post(context.Background(), at, "/", []byte("{}"), "id", "")
			if !errors.Is(err, errMalformedAnswer) || !strings.Contains(err.Error(), name) {
				t.Fatalf("error %v, want a malformed answer naming %q", err, name)
			}
		})
	}
}

// backdate makes every idle connection to host look idle for `by` longer.
func backdate(pool *upstreamPool, host string, by time.Duration) {
	pool.mu.Lock()
	defer pool.mu.Unlock()
	for _, c := range pool.idle[host] {
		c.lastUsed = c.lastUsed.Add(-by)
	}
}

// A connection idle for a while is reused as long as its engine keeps it open, and given up
// before anything is sent on it once the engine has closed it (vLLM does after ~5 s idle):
// a burst after a lull neither reopens every connection nor fails a first attempt on each.
func TestAnIdleConnectionIsReusedUntilItsEngineClosesIt(t *testing.T) {
	server, at, opened := engineServer(t, func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "ok")
	})
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	for i := range 2 {
		response, err := pool.post(context.Background(), at, "/", nil, "id", "")
		if err != nil {
			t.Fatal(err)
		}
		read(t, response)
		backdate(pool, at.host, 2*time.Second)
		if opened.Load() != 1 {
			t.Fatalf("request %d: %d connections, want 1: the idle one is still open", i, opened.Load())
		}
	}
	idle := pool.idle[at.host][0]
	server.CloseClientConnections()
	for deadline := time.Now().Add(5 * time.Second); !peerClosed(idle.conn); {
		if time.Now().After(deadline) {
			t.Fatal("the engine's close never reached the idle connection")
		}
		time.Sleep(10 * time.Millisecond) // polling for the FIN, with a deadline
	}
	next, err := pool.get(context.Background(), at)
	if err != nil {
		t.Fatal(err)
	}
	defer next.conn.Close()
	if next == idle || next.reused {
		t.Fatal("the connection the engine closed was handed out again")
	}
}

// What a burst opened is closed once it has been idle for keepFor, when another connection to
// the same engine is given back.
func TestAConnectionIdleLongerThanKeepForIsClosed(t *testing.T) {
	at, _ := engine(t, func(http.ResponseWriter, *http.Request) {})
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	first, err := pool.get(context.Background(), at)
	if err != nil {
		t.Fatal(err)
	}
	second, err := pool.get(context.Background(), at)
	if err != nil {
		t.Fatal(err)
	}
	pool.put(first)
	backdate(pool, at.host, 2*time.Minute)
	pool.put(second)
	if idle := pool.idle[at.host]; len(idle) != 1 || idle[0] != second {
		t.Fatalf("%d idle connections, want only the one just given back", len(idle))
	}
	if _, err := first.conn.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("reading the expired connection: %v, want it closed", err)
	}
}

// answerOver is an answer read from one end of a pipe: the test writes the engine's side.
func answerOver(t *testing.T) (*upBody, net.Conn) {
	t.Helper()
	ours, engine := net.Pipe()
	t.Cleanup(func() { ours.Close(); engine.Close() })
	c := &upConn{conn: ours, tcp: ours, reader: bufio.NewReaderSize(ours, 16*1024)}
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	return &upBody{pool: pool, conn: c, stop: func() bool { return true }}, engine
}

const chunkedHead = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

// A stream's events that arrived together reach the client in one write, the stream's end
// with them, and the connection goes back to the pool.
func TestChunksThatArrivedTogetherAreReadInOneCall(t *testing.T) {
	answer, engine := answerOver(t)
	go io.WriteString(engine, chunkedHead+"6\r\ndata 1\r\n6\r\ndata 2\r\n6\r\ndata 3\r\n0\r\n\r\n")
	if err := answer.readHead(answer.conn.reader); err != nil {
		t.Fatal(err)
	}
	into := make([]byte, 1024)
	n, err := answer.Read(into)
	if string(into[:n]) != "data 1data 2data 3" || err != io.EOF {
		t.Fatalf("one read gave %q, %v; want the three events and the end", into[:n], err)
	}
	if idle := answer.pool.idle[""]; len(idle) != 1 || idle[0] != answer.conn {
		t.Fatal("the connection was not given back after the stream's end")
	}
}

// An event whose framing has not all arrived is not waited for: what did arrive goes now.
func TestAChunkNotYetArrivedIsNotWaitedFor(t *testing.T) {
	answer, engine := answerOver(t)
	release := make(chan struct{})
	go func() {
		io.WriteString(engine, chunkedHead+"6\r\ndata 1\r\n6") // the next size line cut
		<-release
		io.WriteString(engine, "\r\ndata 2\r\n0\r\n\r\n")
	}()
	if err := answer.readHead(answer.conn.reader); err != nil {
		t.Fatal(err)
	}
	type result struct {
		text string
		err  error
	}
	read := func() chan result {
		done := make(chan result, 1)
		go func() {
			into := make([]byte, 1024)
			n, err := answer.Read(into)
			done <- result{string(into[:n]), err}
		}()
		return done
	}
	select {
	case got := <-read():
		if got.text != "data 1" || got.err != nil {
			t.Fatalf("the first read gave %q, %v; want the first event", got.text, got.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the first event waited for the next one's framing")
	}
	close(release)
	if got := <-read(); got.text != "data 2" || got.err != io.EOF {
		t.Fatalf("the second read gave %q, %v; want the second event and the end", got.text, got.err)
	}
}

// forgingEngine answers its first request, then, once the test closes `forge`, writes a second
// whole answer nobody asked for on the same connection (`forged`: written); every other
// request, on that connection or a new one, is answered "real".
func forgingEngine(t *testing.T, first string, forge <-chan struct{}, forged chan<- struct{}) endpointURL {
	t.Helper()
	var once atomic.Bool
	at, _ := rawEngine(t, func(conn net.Conn) bool {
		if !once.CompareAndSwap(false, true) {
			io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nreal")
			return true
		}
		io.WriteString(conn, first)
		<-forge
		io.WriteString(conn, "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged")
		close(forged)
		return true
	})
	return at
}

// untilReadable waits (in the network poller, consuming nothing) until conn has bytes or its
// peer's close to read.
func untilReadable(t *testing.T, conn net.Conn) {
	t.Helper()
	raw, err := conn.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer conn.SetReadDeadline(time.Time{})
	var one [1]byte
	if err := raw.Read(func(fd uintptr) bool {
		_, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return err != syscall.EAGAIN
	}); err != nil {
		t.Fatalf("nothing arrived on the idle connection: %v", err)
	}
}

// An engine that writes past the end of an answer (a buggy or hostile one, or a proxy in
// front of it) must never have those bytes read as the next request's answer: whether they
// came with the answer or a moment after it, the connection is not used again.
func TestBytesAnEngineSentPastItsAnswerAreNeverTheNextAnswer(t *testing.T) {
	const answer = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirst"
	for _, test := range []struct {
		name  string
		first string
		later bool // the forged answer is written after the first was read
	}{
		{"a moment after the answer", answer, true},
		{"with the answer, in one write", answer + "HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nforged", false},
	} {
		t.Run(test.name, func(t *testing.T) {
			forge, forged := make(chan struct{}), make(chan struct{})
			at := forgingEngine(t, test.first, forge, forged)
			if !test.later {
				close(forge) // and the engine's later write is one more nobody reads
			}
			pool := newUpstreamPool(time.Second, 5*time.Second, time.Minute)
			response, err := pool.post(context.Background(), at, "/", []byte("{}"), "id-1", "")
			if err != nil {
				t.Fatal(err)
			}
			if got := read(t, response); got != "first" {
				t.Fatalf("the first answer: %q", got)
			}
			if test.later {
				idle := pool.idle[at.host]
				if len(idle) != 1 {
					t.Fatalf("%d idle connections after a whole answer, want 1", len(idle))
				}
				close(forge)
				<-forged
				untilReadable(t, idle[0].conn)
			}
			for i := range 2 {
				response, err := pool.post(context.Background(), at, "/", []byte("{}"), "id-2", "")
				if err != nil {
					t.Fatalf("request %d after the forged answer: %v", i, err)
				}
				if got := read(t, response); got != "real" {
					t.Fatalf("request %d after the forged answer was answered %q", i, got)
				}
			}
		})
	}
}

// What checking a pooled connection before reusing it costs: one non-blocking peek.
func BenchmarkReusingAPooledConnection(b *testing.B) {
	at, _ := engine(b, func(http.ResponseWriter, *http.Request) {})
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	c, err := pool.get(context.Background(), at)
	if err != nil {
		b.Fatal(err)
	}
	pool.put(c)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		c, err := pool.get(context.Background(), at)
		if err != nil || !c.reused {
			b.Fatal("the idle connection was not reused", err)
		}
		pool.put(c)
	}
}

// An engine that read the request on a kept-alive connection and closed it without an answer
// (it died mid-request) may have done the work: the request is not sent again (the Python
// gateway's aiohttp does not either), the caller answers the failure.
func TestARequestTheEngineReadBeforeItWentAwayIsNotSentAgain(t *testing.T) {
	ok := scripted{"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", false}
	gone := scripted{"", true}
	at, accepted := scriptedEngine(t, ok, gone, ok)
	pool := newUpstreamPool(time.Second, time.Second, time.Minute)
	response, err := pool.post(context.Background(), at, "/", []byte("{}"), "id", "")
	if err != nil || read(t, response) != "ok" {
		t.Fatalf("first request: %v", err)
	}
	if _, err := pool.post(context.Background(), at, "/", []byte("{}"), "id", ""); err == nil {
		t.Fatal("a request the engine read and dropped was answered: sent again")
	}
	if accepted.Load() != 1 {
		t.Fatalf("%d connections, want the one: nothing sent again", accepted.Load())
	}
}
