package main

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"
)

const waitingTable = `{"version":1,"models":{"m":{"route":"unavailable","groups":[],"render":[],` +
	`"unavailable":{"message":"no healthy decode endpoint","waitSeconds":WAIT}}}}`

func pushTable(t *testing.T, p *plane, table string) {
	t.Helper()
	recorder := httptest.NewRecorder()
	p.putTable(recorder, httptest.NewRequest("PUT", "/table", strings.NewReader(table)))
	if recorder.Code != http.StatusNoContent {
		t.Fatalf("table refused: %d %s", recorder.Code, recorder.Body)
	}
}

// untilWaitingForATable returns once a request waits in p for the next routing table.
func untilWaitingForATable(t *testing.T, p *plane) {
	t.Helper()
	waiting := func() bool { p.tableMu.Lock(); defer p.tableMu.Unlock(); return p.tableMoved != nil }
	for deadline := time.Now().Add(10 * time.Second); !waiting(); runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatal("the request never waited for a table")
		}
	}
}

// A model with no complete set of engines (a rollout replacing its only decode pod): its
// requests wait for a table that has them, as the Python gateway waits (planner.plan), and are
// served by the data plane then; none is handed over.
func TestARequestWithoutEnginesWaitsForATableWithThemAndIsServed(t *testing.T) {
	u := newPlaneUnderTest(t, strings.Replace(waitingTable, "WAIT", "30", 1), nil, nil)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}]}`)
	}))
	defer engine.Close()
	type result struct {
		status int
		body   string
	}
	answered := make(chan result, 1)
	go func() {
		response, err := http.Post(u.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			answered <- result{0, err.Error()}
			return
		}
		defer response.Body.Close()
		body, _ := io.ReadAll(response.Body)
		answered <- result{response.StatusCode, string(body)}
	}()
	untilWaitingForATable(t, u.p)
	pushTable(t, u.p, `{"version":2,"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["`+engine.URL+`"]}]}}}`)
	got := <-answered
	if got.status != 200 || !strings.Contains(got.body, `"finish_reason":"stop"`) {
		t.Fatalf("%d %s, want the engine's answer", got.status, got.body)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
}

// None came within the wait: 503 in the Python gateway's words, Retry-After, counted as it
// counts it (route unknown, outcome no_endpoints).
func TestARequestWithoutEnginesIsAnswered503AfterTheWait(t *testing.T) {
	u := newPlaneUnderTest(t, strings.Replace(waitingTable, "WAIT", "0.05", 1), nil, nil)
	response, body := u.post(t, chatBody)
	want := `{"error":{"message":"no healthy decode endpoint","type":"ServiceUnavailableError","param":null,"code":503}}`
	if response.StatusCode != 503 || body != want || response.Header.Get("Retry-After") != "1" {
		t.Fatalf("%d %s (Retry-After %q), want 503 %s", response.StatusCode, body, response.Header.Get("Retry-After"), want)
	}
	if n := requests(u.p, "unknown", "no_endpoints"); n != 1 {
		t.Fatalf("counted %d no_endpoints", n)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
	if _, _, err := build([]byte(strings.Replace(waitingTable, "WAIT", "-1", 1)), nil); err == nil {
		t.Fatal("a negative wait accepted")
	}
}

// No prefill replica may take P/D (its transport not Verified, no KV-compatible decode): every
// request prefills on decode, counted under the Python gateway's fallback reason.
func TestEveryRequestOfALocalPrefillTableIsCountedUnderItsReason(t *testing.T) {
	table := `{"version":1,"models":{"m":{"route":"decode","localPrefillReason":"transport_unverified",` +
		`"groups":[{"prefill":[],"decode":["URL"]}]}}}`
	u := newPlaneUnderTest(t, table, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}]}`)
	}, nil)
	for range 2 {
		if response, body := u.post(t, chatBody); response.StatusCode != 200 {
			t.Fatalf("%d %s", response.StatusCode, body)
		}
	}
	if got := snapshot(&u.p.stats.localPrefills)["transport_unverified"]; got != 2 {
		t.Fatalf("counted %d, want 2", got)
	}
}

// A request that arrives before the first routing table waits for it (the Python gateway pushes
// it a moment after the data plane listens) and is then served, its key checked as any
// request's; none is handed over.
func TestARequestBeforeTheFirstTableWaitsForItAndItsKeyIsChecked(t *testing.T) {
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"finish_reason":"stop"}]}`)
	}, nil)
	table := u.p.current.Load()
	engine := table.models["m"].decodes[0].at.host
	u.p.current.Store(nil) // as the data plane starts: no table yet
	answered := make(chan int, 2)
	for _, key := range []string{"", "wrong"} {
		go func() {
			request, _ := http.NewRequest("POST", u.url+"/v1/chat/completions", strings.NewReader(chatBody))
			if key != "" {
				request.Header.Set("Authorization", "Bearer "+key)
			}
			response, err := http.DefaultClient.Do(request)
			if err != nil {
				answered <- 0
				return
			}
			response.Body.Close()
			answered <- response.StatusCode
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); u.p.inflight.Load() < 2; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatal("the requests never waited for a table")
		}
	}
	keyed := `{"version":2,"apiKeySha256":["` + sha256Hex("wrong-not") + `"],"models":{"m":{"route":"decode",` +
		`"groups":[{"prefill":[],"decode":["http://` + engine + `"]}]}}}`
	pushTable(t, u.p, keyed)
	got := []int{<-answered, <-answered}
	if got[0] != 401 || got[1] != 401 {
		t.Fatalf("answered %v, want 401 for both: the first table's keys apply", got)
	}
	if seen := u.python.seen(); len(seen) != 0 {
		t.Fatalf("handed to the Python gateway: %v", seen)
	}
	open := `{"version":3,"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["http://` + engine + `"]}]}}}`
	pushTable(t, u.p, open)
	if response, body := u.post(t, chatBody); response.StatusCode != 200 {
		t.Fatalf("%d %s", response.StatusCode, body)
	}
}

func sha256Hex(key string) string {
	digest := sha256.Sum256([]byte(key))
	return hex.EncodeToString(digest[:])
}

// Its entry in the request log names the engines it ran on as the table that brought them
// does: the one it arrived under (mid-rollout, the old pods') knew nothing of them.
func TestARequestThatWaitedForEnginesIsLoggedWithTheirNames(t *testing.T) {
	reader, writer, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reader.Close() })
	const logRoutes = `"requestLog":{"routes":{"pd":"openai_pd","decode":"aggregated","render_pd":"render_pd","render_decode":"render"},`
	waiting := `{"version":1,` + logRoutes + `"names":{}},` + strings.TrimPrefix(strings.Replace(waitingTable, "WAIT", "30", 1), `{"version":1,`)
	var sink *requestLog
	u := newPlaneUnderTest(t, waiting, nil, func(p *plane) {
		sink = newRequestLog(writer)
		p.requestLog = sink
	})
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}`)
	}))
	defer engine.Close()
	answered := make(chan int, 1)
	go func() {
		response, err := http.Post(u.url+"/v1/chat/completions", "application/json", strings.NewReader(chatBody))
		if err != nil {
			answered <- 0
			return
		}
		response.Body.Close()
		answered <- response.StatusCode
	}()
	untilWaitingForATable(t, u.p)
	pushTable(t, u.p, `{"version":2,`+logRoutes+`"names":{"`+engine.URL+`":"decode-new"}},`+
		`"models":{"m":{"route":"decode","groups":[{"prefill":[],"decode":["`+engine.URL+`"]}]}}}`)
	if status := <-answered; status != 200 {
		t.Fatalf("answered %d", status)
	}
	entry := readEntry(t, bufio.NewReader(reader))
	sink.close()
	_ = writer.Close()
	if entry["decode_engine"] != "decode-new" {
		t.Fatalf("decode_engine %v, want decode-new: %v", entry["decode_engine"], entry)
	}
}
