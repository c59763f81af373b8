package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func TestFailuresReachTheClientInThePythonGatewaysWordsWithoutAddresses(t *testing.T) {
	for _, c := range sharedCases[[]struct{ Message, Client string }](t, "without_addresses.json") {
		if got := withoutAddresses(c.Message); got != c.Client {
			t.Errorf("%q\n got %q\nwant %q", c.Message, got, c.Client)
		}
	}
}

const pdTable = `{"version":1,"models":{"m":{"route":"pd","groups":[{"prefill":["URL"],"decode":["URL"]}]}}}`

// A prefill that fails is no failure of the request: decode prefills it locally, sent the
// client's body, and the fallback is counted under the Python gateway's reason. Handed over,
// the engines would do its work twice.
func TestAFailedPrefillFallsBackToLocalPrefillOnDecodeNotToThePythonGateway(t *testing.T) {
	var decodeBodies []map[string]any
	var mu sync.Mutex
	u := newPlaneUnderTest(t, pdTable, func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		json.NewDecoder(r.Body).Decode(&body)
		if body["max_tokens"] == 1.0 { // prefill
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, `{"error":{"message":"prefill broke at http://10.0.0.1:8000"}}`)
			return
		}
		mu.Lock()
		decodeBodies = append(decodeBodies, body)
		mu.Unlock()
		io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
	}, nil)
	response, text := u.post(t, chatBody)
	if response.StatusCode != 200 || !strings.Contains(text, "hi") {
		t.Fatalf("%d %s", response.StatusCode, text)
	}
	if len(u.python.seen()) != 0 {
		t.Fatal("handed over after prefill failed")
	}
	if len(decodeBodies) != 1 || decodeBodies[0]["kv_transfer_params"] != nil {
		t.Fatalf("decode was sent %v, want the client's body once", decodeBodies)
	}
	if got := snapshot(&u.p.stats.localPrefills); got["prefill_failed"] != 1 {
		t.Fatalf("local prefills %v, want prefill_failed: 1", got)
	}
	if n := requests(u.p, routePD, "ok"); n != 1 {
		t.Fatalf("pd/ok counted %d", n)
	}
}

// A decode that fails after its work began is answered as the Python gateway answers it: 502,
// its words without the cluster's addresses; a 4xx as the engine said it.
func TestAFailedDecodeIsAnsweredHereInThePythonGatewaysWords(t *testing.T) {
	for _, c := range []struct {
		name, engine, want string
		status             int
		outcome            string
	}{
		{"5xx", `{"error":{"message":"boom at http://10.0.0.9:8000"}}`,
			`decode at a replica: HTTP 500: boom at a replica`, 502, "error_502"},
		{"non-JSON 200", ``, `decode at a replica answered non-JSON`, 502, "error_502"},
		{"no choices", `{"object":"surprise"}`, `decode answered without choices`, 502, "error_502"},
		{"4xx", `{"error":{"message":"too long"}}`, `too long`, 400, "error_400"},
	} {
		t.Run(c.name, func(t *testing.T) {
			u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
				switch c.name {
				case "5xx":
					w.WriteHeader(500)
				case "4xx":
					w.WriteHeader(400)
				case "non-JSON 200":
					io.WriteString(w, "<html>502</html>")
					return
				}
				io.WriteString(w, c.engine)
			}, nil)
			response, text := u.post(t, chatBody)
			var answer struct{ Error map[string]any }
			json.Unmarshal([]byte(text), &answer)
			if response.StatusCode != c.status || answer.Error["message"] != c.want ||
				answer.Error["code"] != float64(c.status) || len(answer.Error) != 4 {
				t.Fatalf("%d %s, want %d %q", response.StatusCode, text, c.status, c.want)
			}
			if len(u.python.seen()) != 0 {
				t.Fatal("handed over after decode began")
			}
			if n := requests(u.p, routeDecode, c.outcome); n != 1 {
				t.Fatalf("decode/%s counted %d", c.outcome, n)
			}
		})
	}
}

// What the client is not told (the engine's address) stays in the gateway's log, under the id
// the answer names (every answer names its request, an error too), as the Python gateway logs
// it; a client's own mistake (4xx) is not logged.
func TestAFailureAnsweredHereIsLoggedWithWhereItFailed(t *testing.T) {
	var logged bytes.Buffer
	log.SetOutput(&logged)
	t.Cleanup(func() { log.SetOutput(os.Stderr) })
	status := 500
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(status)
		io.WriteString(w, `{"error":{"message":"boom at http://10.0.0.9:8000"}}`)
	}, nil)
	response, text := u.post(t, chatBody, "X-Request-Id", "client-7")
	if response.StatusCode != 502 || strings.Contains(text, "10.0.0.9") {
		t.Fatalf("%d %s", response.StatusCode, text)
	}
	if echoed := response.Header.Get("X-Request-Id"); echoed != "client-7" { // echo_request_id
		t.Fatalf("the error answer echoed X-Request-Id %q", echoed)
	}
	id := response.Header.Get("X-PDServe-Request-Id")
	want := fmt.Sprintf("pdserve-dataplane: %s: answered 502: decode at http://", id)
	if id == "" || !strings.Contains(logged.String(), want) ||
		!strings.Contains(logged.String(), "HTTP 500: boom at http://10.0.0.9:8000") {
		t.Fatalf("logged %q, want a line with %q and the engine's words", logged.String(), want)
	}
	logged.Reset()
	status = 400
	if response, _ := u.post(t, chatBody); response.StatusCode != 400 || logged.Len() != 0 {
		t.Fatalf("a 4xx (%d) logged %q", response.StatusCode, logged.String())
	}
}

// A stream's events are checked before they are passed on: a malformed one ends the stream
// with an error event ("param": null, as every error of the Python gateway's) and [DONE].
func TestAMalformedStreamEventEndsTheStreamWithAnErrorEvent(t *testing.T) {
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n")
		io.WriteString(w, "data: {\"choices\": \"surprise\"}\n\n")
	}, nil)
	response, text := u.post(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	events := strings.Split(strings.TrimSpace(text), "\n\n")
	if response.StatusCode != 200 || len(events) != 3 || strings.Contains(text, "surprise") ||
		events[2] != "data: [DONE]" {
		t.Fatalf("%d %q", response.StatusCode, text)
	}
	var failed struct{ Error map[string]any }
	if err := json.Unmarshal([]byte(strings.TrimPrefix(events[1], "data: ")), &failed); err != nil ||
		failed.Error["code"] != 502.0 || len(failed.Error) != 4 {
		t.Fatalf("error event %q", events[1])
	}
	if _, ok := failed.Error["param"]; !ok {
		t.Fatalf("error event without param: %q", events[1])
	}
	if n := requests(u.p, routeDecode, "error_502"); n != 1 {
		t.Fatalf("decode/error_502 counted %d", n)
	}
}

// A client that leaves mid-stream is counted client_gone, nothing written for it; behind
// render servers decode is told to abort the request by its engine's name for it.
func TestAClientLeavingMidStreamIsClientGoneAndItsTokensDecodeAborted(t *testing.T) {
	var aborted atomic.Value
	sent := make(chan string, 4)
	u := newPlaneUnderTest(t, `{"version":1,"models":{"m":{"route":"decode","render":["URL"],
		"groups":[{"prefill":[],"decode":["URL"]}]}}}`, func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		switch r.URL.Path {
		case "/v1/chat/completions/render":
			io.WriteString(w, `{"token_ids":[1,2],"sampling_params":{"max_tokens":8}}`)
		case abortPath:
			aborted.Store(string(raw))
		case generatePath:
			sent <- r.Header.Get("X-Request-Id")
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"token_ids\":[7],\"finish_reason\":null}]}\n\n")
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		case "/v1/chat/completions/derender":
			io.WriteString(w, `{"chunk":{"choices":[{"index":0,"delta":{"content":"t"},"finish_reason":null}]},"stream_state":null}`)
		}
	}, nil)
	response := u.opened(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`)
	if _, err := bufio.NewReader(response.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	id := <-sent
	response.Body.Close() // the client leaves
	deadline := time.Now().Add(5 * time.Second)
	for requests(u.p, routeRenderDecode, "client_gone") != 1 || aborted.Load() == nil {
		if time.Now().After(deadline) {
			t.Fatalf("counted %v, aborted %v", u.p.metrics.snapshot()["requests"], aborted.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if want := `{"request_ids":["generate-tokens-` + id + `"]}`; aborted.Load() != want {
		t.Fatalf("aborted %v, want %s", aborted.Load(), want)
	}
	if n := u.p.stats.aborts.Load(); n != 1 { // pdserve_gateway_upstream_aborts_total
		t.Fatalf("aborts counted %d, want 1", n)
	}
}

// outOfTimeCase is one of testdata/out_of_time.json, which the Python gateway's tests read
// too (tests/unit/gateway/test_out_of_time_cases.py).
type outOfTimeCase struct {
	Name           string  `json:"name"`
	Stage          string  `json:"stage"`
	URL            string  `json:"url"`
	ConnectionMade bool    `json:"connectionMade"`
	Waited         float64 `json:"waited"`
	ConnectTimeout float64 `json:"connectTimeout"`
	Message        string  `json:"message"`
}

func TestACallOutOfTimeIsNamedAsTheSharedCaseSays(t *testing.T) {
	seconds := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	for _, c := range sharedCases[[]outOfTimeCase](t, "out_of_time.json") {
		got := outOfTimeWords(c.Stage, c.URL, !c.ConnectionMade, seconds(c.Waited), seconds(c.ConnectTimeout))
		if got != c.Message {
			t.Errorf("%s: %q, want %q", c.Name, got, c.Message)
		}
	}
}

func TestADialThatTimesOutIsToldFromAnAnswerThatDidNot(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: os.ErrDeadlineExceeded} // as DialContext fails
	read := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	if !dialTimedOut(fmt.Errorf("post: %w", dial)) {
		t.Error("a dial past its timeout not told apart")
	}
	if dialTimedOut(read) || dialTimedOut(refused) || dialTimedOut(os.ErrDeadlineExceeded) {
		t.Error("an answer's deadline, or a refused dial, taken for a dial that timed out")
	}
}

// The prompt an engine was sent weighs on its load until it is prefilled there (upstream.counted):
// a prefill call until it answers, a local stream until its first event; decode sent prefill's
// KV owes nothing.
func TestAnEnginesLoadCountsThePromptItWasSentUntilItIsPrefilled(t *testing.T) {
	prompt := `[{"role":"user","content":"` + strings.Repeat("x", 4000) + `"}]`
	owed := int64(len(prompt) / 4) // estimatedPromptTokens: 4 bytes of the prompt's JSON a token
	for _, c := range []struct {
		name, table         string
		stream              bool
		atPrefill, atDecode int64
	}{
		{"P/D", pdTable, false, owed, 0},
		{"P/D streamed", pdTable, true, owed, 0},
		{"local, streamed", decodeTable, true, -1, owed},
	} {
		t.Run(c.name, func(t *testing.T) {
			var engine **endpoint
			var mu sync.Mutex
			seen := map[string]int64{}
			u := newPlaneUnderTest(t, c.table, func(w http.ResponseWriter, r *http.Request) {
				var body map[string]any
				json.NewDecoder(r.Body).Decode(&body)
				stage := "decode"
				if body["max_tokens"] == 1.0 {
					stage = "prefill"
				}
				mu.Lock()
				seen[stage] = (*engine).backlog.Load()
				mu.Unlock()
				if body["stream"] == true {
					w.Header().Set("Content-Type", "text/event-stream")
					io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n")
					return
				}
				io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}],"kv_transfer_params":{"remote_host":"h"}}`)
			}, nil)
			for _, e := range u.p.engines {
				engine = &e
			}
			body := `{"model":"m","stream":` + strconv.FormatBool(c.stream) + `,"messages":` + prompt + `}`
			if response, text := u.post(t, body); response.StatusCode != 200 {
				t.Fatalf("%d %s", response.StatusCode, text)
			}
			mu.Lock()
			defer mu.Unlock()
			if got, ok := seen["prefill"]; c.atPrefill >= 0 && got != c.atPrefill || c.atPrefill < 0 && ok {
				t.Errorf("prefill saw %d tokens owed, want %d", got, c.atPrefill)
			}
			if seen["decode"] != c.atDecode {
				t.Errorf("decode saw %d tokens owed, want %d", seen["decode"], c.atDecode)
			}
			if left := (*engine).backlog.Load(); left != 0 {
				t.Errorf("%d tokens still owed after the answer", left)
			}
		})
	}
}

// Past prefill's lease (the table's kvStartWithinSeconds after prefill answered) decode is not
// sent prefill's KV, which would be gone: it prefills the client's body itself, counted under
// the Python gateway's reason (lease_expiring); within it, decode pulls the KV. Streamed or not.
func TestADecodePastPrefillsLeaseIsSentNoKV(t *testing.T) {
	for _, c := range []struct {
		within     string
		stream     bool
		wantKV     bool
		wantLocals map[string]int64
	}{
		{"-0.5", false, false, map[string]int64{"lease_expiring": 1}},
		{"-0.5", true, false, map[string]int64{"lease_expiring": 1}},
		{"60", false, true, map[string]int64{}},
		{"60", true, true, map[string]int64{}},
	} {
		var mu sync.Mutex
		var decodeBodies []map[string]any
		table := strings.Replace(pdTable, `"route":"pd"`, `"route":"pd","kvStartWithinSeconds":`+c.within, 1)
		u := newPlaneUnderTest(t, table, func(w http.ResponseWriter, r *http.Request) {
			var body map[string]any
			json.NewDecoder(r.Body).Decode(&body)
			if body["max_tokens"] == 1.0 { // prefill
				io.WriteString(w, `{"choices":[{"index":0,"message":{"content":""},"finish_reason":"length"}],`+
					`"kv_transfer_params":{"remote_engine_id":"e","remote_block_ids":[1]}}`)
				return
			}
			mu.Lock()
			decodeBodies = append(decodeBodies, body)
			mu.Unlock()
			if body["stream"] == true {
				w.Header().Set("Content-Type", "text/event-stream")
				io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
				return
			}
			io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
		}, nil)
		body := chatBody
		if c.stream {
			body = strings.Replace(chatBody, `{"model"`, `{"stream":true,"model"`, 1)
		}
		response, text := u.post(t, body)
		if response.StatusCode != 200 || !strings.Contains(text, "hi") {
			t.Fatalf("within %s, stream %v: %d %s", c.within, c.stream, response.StatusCode, text)
		}
		if len(decodeBodies) != 1 || (decodeBodies[0]["kv_transfer_params"] != nil) != c.wantKV {
			t.Fatalf("within %s, stream %v: decode was sent %v, want prefill's KV: %v", c.within, c.stream, decodeBodies, c.wantKV)
		}
		if got := snapshot(&u.p.stats.localPrefills); fmt.Sprint(got) != fmt.Sprint(c.wantLocals) {
			t.Fatalf("within %s, stream %v: local prefills %v, want %v", c.within, c.stream, got, c.wantLocals)
		}
		if len(u.python.seen()) != 0 {
			t.Fatal("handed over")
		}
	}
}
