package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// framedServer is the data plane's client server (framedListener, its ConnState) over a
// handler that answers "ok" after reading the body; it counts the requests it served.
func framedServer(t *testing.T, maxBody int64) (string, *atomic.Int64) {
	t.Helper()
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := new(atomic.Int64)
	server := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, err := io.Copy(io.Discard, r.Body); err != nil {
				return
			}
			served.Add(1)
			_, _ = io.WriteString(w, "ok")
		}),
		MaxHeaderBytes: maxHeaderBytes, ConnState: trackServerState,
	}
	go func() { _ = server.Serve(framedListener{rawListener{listener}, maxBody}) }()
	t.Cleanup(func() { _ = server.Close() })
	return listener.Addr().String(), served
}

// exchange sends raw bytes and reads every answer until the server closes the connection.
func exchange(t *testing.T, address string, raw string) []*http.Response {
	t.Helper()
	conn, err := net.Dial("tcp", address)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	reader := bufio.NewReader(conn)
	var answers []*http.Response
	for {
		response, err := http.ReadResponse(reader, nil)
		if err != nil {
			if err != io.EOF && !errors_isClosed(err) {
				t.Fatalf("after %d answers: %v (the server must close after its refusal)", len(answers), err)
			}
			return answers
		}
		body, _ := io.ReadAll(response.Body)
		response.Body = io.NopCloser(bytes.NewReader(body))
		answers = append(answers, response)
		if response.Close {
			if _, err := reader.ReadByte(); err != io.EOF {
				t.Fatalf("bytes or no end after a Connection: close answer: %v", err)
			}
			return answers
		}
	}
}

func errors_isClosed(err error) bool {
	return strings.Contains(err.Error(), "connection reset")
}

type openAIError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    int     `json:"code"`
	} `json:"error"`
}

func refusal(t *testing.T, response *http.Response) openAIError {
	t.Helper()
	var answer openAIError
	body, _ := io.ReadAll(response.Body)
	if response.Header.Get("Content-Type") != "application/json" || json.Unmarshal(body, &answer) != nil {
		t.Fatalf("%d %s %q: not the OpenAI error shape", response.StatusCode, response.Header.Get("Content-Type"), body)
	}
	if answer.Error.Code != response.StatusCode || answer.Error.Message == "" || answer.Error.Type == "" {
		t.Fatalf("%d: error %+v", response.StatusCode, answer.Error)
	}
	return answer
}

const models = "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"

func TestARequestWithBothLengthsIsRefusedAndWhatFollowsItsBodyIsNeverServed(t *testing.T) {
	address, served := framedServer(t, 1<<20)
	for _, head := range []string{
		"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
		"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
	} {
		// TE.CL: a server reading the chunked body would serve the smuggled GET next.
		answers := exchange(t, address, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"+head+"\r\n0\r\n\r\n"+models)
		if len(answers) != 1 || answers[0].StatusCode != 400 || !answers[0].Close {
			t.Fatalf("%q: %d answers, want one 400 that closes", head, len(answers))
		}
		if message := refusal(t, answers[0]).Error.Message; !strings.Contains(message, "both Content-Length and Transfer-Encoding") {
			t.Fatalf("message %q does not say what to fix", message)
		}
	}
	if served.Load() != 0 {
		t.Fatalf("%d requests reached the handler", served.Load())
	}
}

func TestMalformedRequestsGetThePythonGatewaysStatusInTheOpenAIShape(t *testing.T) {
	address, served := framedServer(t, 1000)
	long := strings.Repeat("a", 70000)
	for _, c := range []struct {
		name, raw string
		status    int
		kind      string
	}{
		{"duplicate equal Content-Length", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400, "BadRequestError"},
		{"Content-Length list", "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}", 400, "BadRequestError"},
		{"obs-fold", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n", 400, "BadRequestError"},
		{"bare LF", "GET / HTTP/1.1\nHost: x\n\n", 400, "BadRequestError"},
		{"bare LF in a header", "GET / HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n", 400, "BadRequestError"},
		{"70 KB header line", "GET / HTTP/1.1\r\nHost: x\r\nX-A: " + long + "\r\n\r\n", 431, "RequestHeaderFieldsTooLarge"},
		{"9 KB target", "GET /" + long[:9000] + " HTTP/1.1\r\nHost: x\r\n\r\n", 431, "RequestHeaderFieldsTooLarge"},
		{"129 headers", "GET / HTTP/1.1\r\nHost: x\r\n" + strings.Repeat("X-A: b\r\n", 128) + "\r\n", 400, "BadRequestError"},
		{"unknown Transfer-Encoding", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "BadRequestError"},
		{"Transfer-Encoding twice", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "BadRequestError"},
		{"chunked HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "BadRequestError"},
		{"control character", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n", 400, "BadRequestError"},
		{"space in a name", "GET / HTTP/1.1\r\nHost: x\r\nX-A : b\r\n\r\n", 400, "BadRequestError"},
		{"no Host", "GET / HTTP/1.1\r\n\r\n", 400, "BadRequestError"},
		{"Host twice", "GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "BadRequestError"},
		{"bad chunk size", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "BadRequestError"},
		{"bare LF after a chunk size", "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n", 400, "BadRequestError"},
		{"unknown Expect", "POST / HTTP/1.1\r\nHost: x\r\nExpect: fish\r\nContent-Length: 2\r\n\r\n{}", 417, "ExpectationFailed"},
		{"100-continue for too large a body", "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 50000000\r\n\r\n", 413, "RequestTooLarge"},
	} {
		answers := exchange(t, address, c.raw)
		if len(answers) != 1 || answers[0].StatusCode != c.status || !answers[0].Close {
			var got []int
			for _, a := range answers {
				got = append(got, a.StatusCode)
			}
			t.Errorf("%s: answers %v, want one %d that closes", c.name, got, c.status)
			continue
		}
		if answer := refusal(t, answers[0]); answer.Error.Type != c.kind || answer.Error.Param != nil {
			t.Errorf("%s: %+v, want type %s", c.name, answer.Error, c.kind)
		}
	}
	if served.Load() != 0 {
		t.Fatalf("%d refused requests reached the handler", served.Load())
	}
}

func TestValidFramingsPassWholeAndAPipelinedRefusalFollowsTheAnswerBeforeIt(t *testing.T) {
	address, served := framedServer(t, 1000)
	valid := "\r\nPOST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" +
		"POST / HTTP/1.1\r\nhost: x\r\nTransfer-Encoding: Chunked\r\n\r\n2;ext=1\r\n{}\r\n0\r\nTrailer: t\r\n\r\n" +
		"GET / HTTP/1.0\r\nExpect: 100-continue\r\nConnection: keep-alive\r\n\r\n"
	answers := exchange(t, address, valid+"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx")
	if len(answers) != 4 || served.Load() != 3 {
		t.Fatalf("%d answers, %d served; want 3 served then the refusal", len(answers), served.Load())
	}
	for _, a := range answers[:3] {
		if a.StatusCode != 200 {
			t.Fatalf("a valid request got %d", a.StatusCode)
		}
	}
	if answers[3].StatusCode != 400 || !answers[3].Close {
		t.Fatalf("the pipelined faulty request got %d", answers[3].StatusCode)
	}
	refusal(t, answers[3])
}

// FuzzFraming: the checker never panics, and every message it lets through Go's parser reads
// with the same end (no message can be read as a different one, or as two).
func FuzzFraming(f *testing.F) {
	for _, seed := range []string{
		models,
		"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" + models,
		"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2;a=b\r\n{}\r\n0\r\nT: v\r\n\r\n" + models,
		"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + models,
		"\r\n\r\nGET / HTTP/1.0\r\n\r\n",
	} {
		f.Add([]byte(seed), uint8(7))
	}
	f.Fuzz(func(t *testing.T, stream []byte, split uint8) {
		var ends []int64
		checker := requestFraming{maxBody: 1 << 20, onMessage: func(end int64) { ends = append(ends, end) }}
		var passed []byte
		step := int(split%64) + 1
		for from := 0; from < len(stream) && checker.fault == nil; from += step {
			chunk := append([]byte(nil), stream[from:min(from+step, len(stream))]...)
			passed = append(passed, chunk[:checker.scan(chunk)]...)
		}
		if int64(len(passed)) != checker.offset {
			t.Fatalf("offset %d, passed %d", checker.offset, len(passed))
		}
		source := bytes.NewReader(passed)
		reader := bufio.NewReader(source)
		for i := 0; ; i++ {
			request, err := http.ReadRequest(reader)
			if err != nil {
				return // Go's parser refuses (its server closes the connection), or the end
			}
			_, err = io.Copy(io.Discard, request.Body)
			if i >= len(ends) {
				if err == nil {
					t.Fatalf("Go read a whole message %d the checker did not see end", i)
				}
				return
			}
			if err != nil {
				return // its body is refused: the server closes the connection
			}
			if at := int64(len(passed) - source.Len() - reader.Buffered()); at != ends[i] {
				t.Fatalf("message %d ends at %d for Go, at %d for the checker", i, at, ends[i])
			}
		}
	})
}
