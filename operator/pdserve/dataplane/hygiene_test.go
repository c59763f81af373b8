package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestMain lets a test start this test binary as the data plane itself (its main(), flags and
// all): what a test checks of the control API or the client port is then what the Python
// gateway starts.
func TestMain(m *testing.M) {
	if os.Getenv("PDSERVE_DATAPLANE_TEST_AS_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runningPlane is the data plane started as the Python gateway starts it.
type runningPlane struct {
	listen, control, token string
}

func runDataPlane(t *testing.T, python string, flags ...string) runningPlane {
	t.Helper()
	token := "test-token-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	args := append([]string{"-listen", "127.0.0.1:0", "-python", python, "-control", "127.0.0.1:0",
		"-latency-buckets", "0.1,1", "-count-buckets", "1,2"}, flags...)
	command := exec.Command(os.Args[0], args...)
	command.Env = append(os.Environ(), "PDSERVE_DATAPLANE_TEST_AS_MAIN=1", tokenVariable+"="+token)
	command.Stderr = os.Stderr
	stdout, err := command.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := command.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		command.Process.Kill()
		command.Wait()
	})
	var bound struct{ Control, Listen string }
	line, err := bufio.NewReader(stdout).ReadBytes('\n')
	if err := errors.Join(err, json.Unmarshal(line, &bound)); err != nil {
		t.Fatalf("the data plane did not start with %v: %v (its error is above)", flags, err)
	}
	return runningPlane{listen: bound.Listen, control: "http://" + bound.Control, token: token}
}

// call makes one control call, with `token` unless it is empty.
func (r runningPlane) call(t *testing.T, method, path, token, body string) (int, string) {
	t.Helper()
	request, _ := http.NewRequest(method, r.control+path, strings.NewReader(body))
	if token != "" {
		request.Header.Set("Authorization", "Bearer "+token)
	}
	response, err := http.DefaultClient.Do(request)
	if err != nil {
		t.Fatal(err)
	}
	defer response.Body.Close()
	text, _ := io.ReadAll(response.Body)
	return response.StatusCode, string(text)
}

// pythonStub stands in for the Python gateway: it records what it was handed, answers 200 (or
// as `hold` says).
type pythonStub struct {
	mu      sync.Mutex
	headers []http.Header
	arrived chan struct{}
	hold    func(r *http.Request) bool // wait for release before answering
	release chan struct{}
}

func (s *pythonStub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	s.mu.Lock()
	s.headers = append(s.headers, r.Header.Clone())
	s.mu.Unlock()
	s.arrived <- struct{}{}
	if s.hold != nil && s.hold(r) {
		<-s.release
	}
	w.Header().Set("Content-Type", "application/json")
	io.WriteString(w, `{"served by":"python"}`)
}

func (s *pythonStub) seen() []http.Header {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]http.Header(nil), s.headers...)
}

// planeUnderTest is a data plane in this process, its client port served as main() serves it,
// in front of an engine and a pythonStub.
type planeUnderTest struct {
	p      *plane
	url    string
	python *pythonStub
}

const testToken = "the-gateways-token"

func newPlaneUnderTest(t *testing.T, table string, engine http.HandlerFunc, configure func(*plane)) *planeUnderTest {
	t.Helper()
	stub := &pythonStub{arrived: make(chan struct{}, 100), release: make(chan struct{})}
	pythonServer := httptest.NewServer(stub)
	t.Cleanup(pythonServer.Close)
	target, _ := url.Parse(pythonServer.URL)
	p := &plane{python: pythonProxy(target, testToken, http.DefaultTransport),
		upstream: newUpstreamPool(time.Second, 10*time.Second, time.Minute),
		maxBody:  1 << 20, maxInflight: 16, engines: map[string]*endpoint{},
		timeouts: timeouts{idle: 5 * time.Second, request: 10 * time.Second, body: 10 * time.Second,
			render: 5 * time.Second},
		queue: newFairQueue(), metrics: newServedMetrics([]float64{0.01, 1}, []float64{1, 2, 4})}
	p.buffers.New = func() any { return new(bytes.Buffer) }
	p.chunks.New = func() any { chunk := make([]byte, 32*1024); return &chunk }
	if configure != nil {
		configure(p)
	}
	if engine != nil {
		engineServer := httptest.NewServer(engine)
		t.Cleanup(engineServer.Close)
		table = strings.ReplaceAll(table, "URL", engineServer.URL)
	}
	built, engines, err := build([]byte(table), nil)
	if err != nil {
		t.Fatal(err)
	}
	p.engines = engines
	p.current.Store(built)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", p.serveCompletion)
	mux.HandleFunc("POST /v1/completions", p.serveCompletion)
	mux.Handle("/", p.python)
	client := httptest.NewServer(mux)
	t.Cleanup(client.Close)
	t.Cleanup(func() { // first: what the stub holds would keep the servers from closing
		select {
		case <-stub.release:
		default:
			close(stub.release)
		}
	})
	return &planeUnderTest{p: p, url: client.URL, python: stub}
}

// opened posts a chat body and answers the response unread (a stream the test reads as it
// comes); closed when the test ends.
func (u *planeUnderTest) opened(t *testing.T, body string) *http.Response {
	t.Helper()
	request, _ := http.NewRequest("POST", u.url+"/v1/chat/completions", strings.NewReader(body))
	response, err := http.DefaultClient.Do(request)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { response.Body.Close() })
	return response
}

func (u *planeUnderTest) post(t *testing.T, body string, headers ...string) (*http.Response, string) {
	t.Helper()
	request, _ := http.NewRequest("POST", u.url+"/v1/chat/completions", strings.NewReader(body))
	for i := 0; i+1 < len(headers); i += 2 {
		request.Header.Set(headers[i], headers[i+1])
	}
	response, err := http.DefaultClient.Do(request)
	if err != nil {
		t.Fatal(err)
	}
	defer response.Body.Close()
	text, _ := io.ReadAll(response.Body)
	return response, string(text)
}

// requests: the data plane's own count of requests by route and outcome, as folded into the
// gateway's pdserve_gateway_requests_total.
func requests(p *plane, route, outcome string) int64 {
	for _, each := range p.metrics.snapshot()["requests"].([]requestCountJSON) {
		if each.Route == route && each.Outcome == outcome {
			return each.Count
		}
	}
	return 0
}

const chatBody = `{"model":"m","messages":[{"role":"user","content":"hi"}]}`

const decodeTable = `{"version":1,"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["URL"]}]}}}`

// ---- 4: a hand-over never restarts the request's timeouts --------------------------------------

// A request whose fast path waited out the request timeout is answered 504 as the Python
// gateway answers it: handed over, it would start again with a whole new timeout, the engines
// doing its work twice.
func TestARequestPastItsDeadlineIsAnswered504NotHandedOver(t *testing.T) {
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // read: its server then sees the data plane leave
		<-r.Context().Done()        // a decode that never answers
	}, func(p *plane) { p.timeouts.request = 300 * time.Millisecond })
	response, body := u.post(t, chatBody)
	want := `{"error":{"message":"decode at a replica did not answer within the request's limit of 0.3 s","type":"GatewayTimeout","param":null,"code":504}}`
	if response.StatusCode != 504 || body != want {
		t.Fatalf("%d %s, want 504 %s", response.StatusCode, body, want)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway after its deadline: %v", seen)
	}
	if n := requests(u.p, routeDecode, "error_504"); n != 1 {
		t.Fatalf("counted %d times as decode/error_504, want 1", n)
	}
}

// Handed over after the fast path spent time on it, a request carries that time to the Python
// gateway beside the data plane's token; a client's own copies of those headers never reach
// it, whichever route the request takes.
func TestAHandOverCarriesTheTimeSpentAndNoClientCopiesOfItsHeaders(t *testing.T) {
	const spent = 150 * time.Millisecond
	u := newPlaneUnderTest(t, decodeTable, func(http.ResponseWriter, *http.Request) {}, nil)
	// A body that takes its time to arrive, for a model the table lacks: handed over (a
	// request the engines began is answered here, never handed over).
	reader, writer := io.Pipe()
	go func() {
		time.Sleep(spent)
		io.WriteString(writer, `{"model":"other","messages":[]}`)
		writer.Close()
	}()
	forged := []string{elapsedHeader, "0", tokenHeader, "guessed", "Connection", tokenHeader}
	slow, _ := http.NewRequest("POST", u.url+"/v1/chat/completions", reader)
	for i := 0; i+1 < len(forged); i += 2 {
		slow.Header.Set(forged[i], forged[i+1])
	}
	sent := time.Now()
	response, err := http.DefaultClient.Do(slow)
	took := time.Since(sent)
	if err != nil {
		t.Fatal(err)
	}
	response.Body.Close()
	if response.StatusCode != 200 {
		t.Fatalf("status %d, want the Python gateway's answer", response.StatusCode)
	}
	request, err := http.NewRequest("GET", u.url+"/v1/models", nil)
	if err != nil {
		t.Fatal(err)
	}
	request.Header.Set(elapsedHeader, "99999")
	request.Header.Set(tokenHeader, "guessed")
	other, err := http.DefaultClient.Do(request)
	if err != nil {
		t.Fatal(err)
	}
	other.Body.Close()
	seen := u.python.seen()
	if len(seen) != 2 {
		t.Fatalf("the Python gateway was handed %d requests, want 2", len(seen))
	}
	handed := seen[0]
	elapsed, err := strconv.Atoi(handed.Get(elapsedHeader))
	// The data plane's clock starts when the headers arrive, after the body's wait began, so
	// only bounds that hold on any machine: some time, and no more than the client saw.
	spentHere := time.Duration(elapsed) * time.Millisecond
	if err != nil || spentHere < time.Millisecond || spentHere > took || handed.Get(tokenHeader) != testToken {
		t.Fatalf("handed over with %s %q, %s %q; want 1..%d ms and the data plane's token",
			elapsedHeader, handed.Values(elapsedHeader), tokenHeader, handed.Values(tokenHeader), took.Milliseconds())
	}
	if len(handed.Values(elapsedHeader)) != 1 || len(handed.Values(tokenHeader)) != 1 {
		t.Fatalf("the client's copies were passed on beside the data plane's: %v", handed)
	}
	if passed := seen[1]; passed.Get(elapsedHeader) != "" || passed.Get(tokenHeader) != "" {
		t.Fatalf("a client's hand-over headers reached the Python gateway: %v", passed)
	}
}

// ---- 7: the control API answers only the Python gateway ---------------------------------------

func TestTheControlAPIAnswersOnlyCallsWithTheGatewaysToken(t *testing.T) {
	r := runDataPlane(t, "http://127.0.0.1:9")
	open := `{"version":9,"models":{}}`
	for _, call := range []struct{ method, path, body string }{
		{"PUT", "/table", open}, {"GET", "/stats", ""}, {"POST", "/drain", ""},
		{"GET", "/health", ""}, {"GET", "/debug/pprof/allocs", ""},
	} {
		for _, token := range []string{"", "not-" + r.token} {
			if status, text := r.call(t, call.method, call.path, token, call.body); status != 401 ||
				!strings.Contains(text, "Authorization: Bearer <token>") {
				t.Fatalf("%s %s with token %q: %d %s, want 401 naming the header", call.method,
					call.path, token, status, text)
			}
		}
	}
	if status, text := r.call(t, "GET", "/stats", r.token, ""); status != 200 || strings.Contains(text, `"version"`) {
		t.Fatalf("stats: %d %s: a table pushed without the token was taken", status, text)
	}
	if status, text := r.call(t, "PUT", "/table", r.token, open); status != 204 {
		t.Fatalf("the gateway's own table: %d %s", status, text)
	}
}

// Started for a gateway that checks API keys, the data plane refuses a table without their
// digests: such a table would serve every client without a key.
func TestATableWithoutKeysIsRefusedWhileTheGatewayRequiresThem(t *testing.T) {
	r := runDataPlane(t, "http://127.0.0.1:9", "-require-api-keys")
	status, text := r.call(t, "PUT", "/table", r.token, `{"version":1,"models":{}}`)
	if status != 422 || !strings.Contains(text, "apiKeySha256") || !strings.Contains(text, "-require-api-keys") {
		t.Fatalf("a table without keys: %d %s, want 422 naming apiKeySha256", status, text)
	}
	digest := strings.Repeat("ab", 32)
	if status, text := r.call(t, "PUT", "/table", r.token,
		`{"version":2,"models":{},"apiKeySha256":["`+digest+`"]}`); status != 204 {
		t.Fatalf("a table with keys: %d %s", status, text)
	}
}

// ---- 8: the key before the body, and the body within its timeout ------------------------------

// rawRequest sends a request head (and `body`, maybe short of its Content-Length) on a new
// connection, and reads the answer within a few seconds.
func rawRequest(t *testing.T, address, head, body string) (*http.Response, string, net.Conn) {
	t.Helper()
	conn, err := net.Dial("tcp", address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(conn, head+body); err != nil {
		t.Fatal(err)
	}
	reader := bufio.NewReader(conn)
	response, err := http.ReadResponse(reader, nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	text, err := io.ReadAll(response.Body)
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	return response, string(text), conn
}

// closedAfter: the data plane closes the connection (nothing more to read, not a wait).
func closedAfter(t *testing.T, conn net.Conn) {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := conn.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("the connection stayed open after the answer: %d %v", n, err)
	}
}

const keyedTable = `{"version":1,"apiKeySha256":["` +
	// sha256("secret")
	`2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b"],` +
	`"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["URL"]}]}}}`

// A request without a valid key is answered 401 at once, in the Python gateway's words, and
// its connection closed: its body (50 MB announced, a few bytes sent) is never waited for.
func TestARequestWithoutItsKeyIs401AtOnceNotAfterItsBody(t *testing.T) {
	u := newPlaneUnderTest(t, keyedTable, func(http.ResponseWriter, *http.Request) {}, nil)
	for _, auth := range []string{"", "Authorization: Bearer wrong\r\n"} {
		head := "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n" + auth +
			"Content-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
		response, body, conn := rawRequest(t, strings.TrimPrefix(u.url, "http://"), head, `{"model":`)
		want := `{"error":{"message":"missing or invalid API key: send Authorization: Bearer <key>","type":"AuthenticationError","param":null,"code":401}}`
		if response.StatusCode != 401 || body != want || !response.Close {
			t.Fatalf("%q: %d %s (closing: %v), want 401 %s and the connection closed", auth,
				response.StatusCode, body, response.Close, want)
		}
		closedAfter(t, conn)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
}

// Two Authorization headers, the right key in either: refused before the body, as the Python
// gateway refuses them (the check read the first, an engine might read the other).
func TestTwoAuthorizationHeadersAreRefusedWhicheverIsRight(t *testing.T) {
	u := newPlaneUnderTest(t, keyedTable, func(http.ResponseWriter, *http.Request) {}, nil)
	for _, keys := range []string{"Bearer secret\r\nAuthorization: Bearer wrong",
		"Bearer wrong\r\nAuthorization: Bearer secret"} {
		head := "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: " + keys +
			"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
		response, body, conn := rawRequest(t, strings.TrimPrefix(u.url, "http://"), head, `{}`)
		want := `{"error":{"message":"the request has more than one Authorization header; send one","type":"BadRequestError","param":null,"code":400}}`
		if response.StatusCode != 400 || body != want {
			t.Fatalf("%q: %d %s, want 400 %s", keys, response.StatusCode, body, want)
		}
		closedAfter(t, conn)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
}

// A client that sends its whole body before it reads the answer, as most do, reads the 401:
// the data plane drops the body as it comes instead of resetting the connection under it.
func TestAKeylessUploadSentWholeBeforeTheAnswerIsReadStillReads401(t *testing.T) {
	u := newPlaneUnderTest(t, keyedTable, func(http.ResponseWriter, *http.Request) {}, nil)
	body := bytes.Repeat([]byte("x"), 8<<20) // more than the sockets' buffers hold
	head := fmt.Sprintf("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n", len(body))
	conn, err := net.Dial("tcp", strings.TrimPrefix(u.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Write(append([]byte(head), body...)); err != nil {
		t.Fatalf("the upload was cut off: %v", err)
	}
	response, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer after the upload: %v", err)
	}
	text, _ := io.ReadAll(response.Body)
	if response.StatusCode != 401 || !strings.Contains(string(text), "missing or invalid API key") {
		t.Fatalf("%d %s, want 401", response.StatusCode, text)
	}
}

// A body that does not arrive within the body timeout is answered 408 as the Python gateway
// answers it, and the connection closed.
func TestABodyThatDoesNotArriveInTimeIs408(t *testing.T) {
	u := newPlaneUnderTest(t, keyedTable, func(http.ResponseWriter, *http.Request) {},
		func(p *plane) { p.timeouts.body = 200 * time.Millisecond })
	head := "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer secret\r\n" +
		"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
	begun := time.Now()
	response, body, conn := rawRequest(t, strings.TrimPrefix(u.url, "http://"), head, `{"model":`)
	want := `{"error":{"message":"the request body did not arrive within 0.2 s","type":"RequestTimeout","param":null,"code":408}}`
	if response.StatusCode != 408 || body != want || !response.Close {
		t.Fatalf("%d %s (closing: %v), want 408 %s and the connection closed", response.StatusCode,
			body, response.Close, want)
	}
	if waited := time.Since(begun); waited < 200*time.Millisecond {
		t.Fatalf("answered after %v, before the body timeout", waited)
	}
	closedAfter(t, conn)
	if n := requests(u.p, "unknown", "error_408"); n != 1 {
		t.Fatalf("counted %d times as unknown/error_408, want 1", n)
	}
}

// ---- 9: idle client connections are closed -------------------------------------------------

func TestIdleClientConnectionsAndStalledHeadsAreClosedAfterTheKeepAliveTimeout(t *testing.T) {
	python := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		io.WriteString(w, "{}")
	}))
	t.Cleanup(python.Close)
	r := runDataPlane(t, python.URL, "-keepalive-timeout-seconds", "0.3")
	for name, sent := range map[string]string{
		"idle after an answer": "GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n",
		"a head never ended":   "GET /v1/models HTTP/1.1\r\nHost: gw\r\n",
		"nothing sent":         "",
	} {
		t.Run(name, func(t *testing.T) {
			conn, err := net.Dial("tcp", r.listen)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			io.WriteString(conn, sent)
			reader := bufio.NewReader(conn)
			if strings.HasSuffix(sent, "\r\n\r\n") {
				conn.SetReadDeadline(time.Now().Add(5 * time.Second))
				response, err := http.ReadResponse(reader, nil)
				if err != nil {
					t.Fatal(err)
				}
				io.Copy(io.Discard, response.Body)
			}
			begun := time.Now()
			conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := reader.ReadByte(); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("after %v: %v, want the data plane to close the connection", time.Since(begun), err)
			}
		})
	}
}

// ---- 10: one in-flight limit per gateway ------------------------------------------------------

// Requests the data plane hands over hold its in-flight slots as the ones it serves do: with
// -max-inflight 2 and two requests at the Python gateway, a third is answered 429 in the Python
// gateway's words and counted where the gateway's metrics see rejections.
func TestOneInFlightLimitCoversTheRequestsHandedOver(t *testing.T) {
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, _ *http.Request) {
		io.WriteString(w, `{"served by":"engine","choices":[{"index":0}]}`)
	}, func(p *plane) { p.maxInflight = 2 })
	u.python.hold = func(r *http.Request) bool { return r.Header.Get("X-Hold") != "" }
	done := make(chan int, 2)
	for range 2 { // no messages: handed to the Python gateway to validate, which takes its time
		go func() {
			request, _ := http.NewRequest("POST", u.url+"/v1/chat/completions",
				strings.NewReader(`{"model":"other","messages":[]}`))
			request.Header.Set("X-Hold", "1")
			response, err := http.DefaultClient.Do(request)
			if err != nil {
				done <- 0
				return
			}
			response.Body.Close()
			done <- response.StatusCode
		}()
	}
	<-u.python.arrived
	<-u.python.arrived
	for _, body := range []string{chatBody, `{"model":"other","messages":[]}`} {
		response, text := u.post(t, body)
		want := `{"error":{"message":"the gateway is at its limit of 2 requests in flight; retry shortly","type":"RateLimitError","param":null,"code":429}}`
		if response.StatusCode != 429 || text != want || response.Header.Get("Retry-After") != "1" {
			t.Fatalf("%s with 2 handed over in flight: %d %s, want 429 %s", body, response.StatusCode, text, want)
		}
	}
	if n := requests(u.p, "unknown", "rejected"); n != 2 {
		t.Fatalf("counted %d rejections as unknown/rejected, want 2", n)
	}
	close(u.python.release)
	for range 2 {
		if status := <-done; status != 200 {
			t.Fatalf("a held request ended %d", status)
		}
	}
	if response, text := u.post(t, chatBody); response.StatusCode != 200 ||
		!strings.Contains(text, "engine") {
		t.Fatalf("once the slots were free: %d %s", response.StatusCode, text)
	}
}
