package main

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// readAnswer reads `raw` as an engine's answer, as the upstream pool reads one: the head, then
// the body by its framing, to its end.
func readAnswer(raw []byte) (status int, body []byte, err error) {
	client, server := net.Pipe()
	defer client.Close() // unblocks the writer when the reader stopped early
	go func() {
		server.Write(raw)
		server.Close()
	}()
	c := &upConn{conn: client, tcp: client, reader: bufio.NewReaderSize(client, 16*1024), pool: "engine"}
	answer := &upBody{pool: newUpstreamPool(time.Second, time.Second, time.Minute), conn: c,
		stop: func() bool { return true }}
	if err := answer.readHead(c.reader); err != nil {
		return 0, nil, err
	}
	defer answer.Close()
	if answer.framing == framedByLength && answer.left == 0 {
		return answer.status, nil, nil
	}
	body, err = io.ReadAll(answer)
	return answer.status, body, err
}

// goReads is what Go's own HTTP client reads of `raw`: the final answer's status and its body
// (interim 1xx answers skipped, as the upstream pool skips them).
func goReads(raw []byte) (status int, body []byte, err error) {
	reader := bufio.NewReader(bytes.NewReader(raw))
	for {
		response, err := http.ReadResponse(reader, nil)
		if err != nil {
			return 0, nil, err
		}
		if response.StatusCode >= 200 {
			body, err := io.ReadAll(response.Body)
			return response.StatusCode, body, err
		}
	}
}

// FuzzAnEnginesAnswerIsReadSafely: the answer head, Content-Length, chunked and until-close
// bodies and their trailers, as an engine (a peer) sends them. Reading never panics or hangs,
// and an answer read whole is the one Go's own client reads: the same status and the same body,
// so no answer can be read as another (a forged chunk, a smuggled second answer).
func FuzzAnEnginesAnswerIsReadSafely(f *testing.F) {
	for _, seed := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=y\r\ndata:\r\n3\r\n {}\r\n0\r\nT: v\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil the engine closes",
		"HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\nContent-Length: 40\r\n\r\n{\"error\":{\"message\":\"engine core died\"}}",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\n Folded: line\r\n\r\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		status, body, err := readAnswer(raw)
		if err != nil {
			return // refused or cut short: the caller answers the client a 502
		}
		goStatus, goBody, goErr := goReads(raw)
		if goErr != nil {
			t.Fatalf("read whole here (%d, %q), Go's client refuses it: %v", status, body, goErr)
		}
		if status != goStatus || !bytes.Equal(body, goBody) {
			t.Fatalf("read as %d %q here, as %d %q by Go's client", status, body, goStatus, goBody)
		}
	})
}
