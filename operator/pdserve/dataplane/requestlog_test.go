package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// The entry's keys, in order, as testdata/request_log_keys.json has them (the Python gateway's
// log_entry is held to the same file).
func TestTheRequestLogEntryHasThePythonGatewaysKeysInOrder(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "request_log_keys.json"))
	if err != nil {
		t.Fatal(err)
	}
	var want struct{ Keys []string }
	if err := json.Unmarshal(raw, &want); err != nil {
		t.Fatal(err)
	}
	s := &served{id: "pdserve-1", started: time.Now(), route: routeDecode}
	l := newLogged(nil, &requestLogJSON{Routes: map[string]string{routeDecode: "aggregated"}}, "chat", "")
	if got := entryKeys(t, l.line(s)); !slices.Equal(got, want.Keys) {
		t.Fatalf("keys %v, want %v", got, want.Keys)
	}
}

// entryKeys: the keys of one JSON object, in the order written.
func entryKeys(t *testing.T, line []byte) []string {
	t.Helper()
	members, err := topLevel(line[:len(line)-1])
	if err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	keys := []string{}
	for _, m := range members {
		keys = append(keys, strings.Trim(string(m.key), `"`))
	}
	return keys
}

// p95 as the Python gateway's request_log.p95 takes it: the element at int(0.95 n).
func TestTheInterTokenP95IsTakenAsThePythonGatewayTakesIt(t *testing.T) {
	gaps := []time.Duration{}
	for i := 20; i >= 1; i-- {
		gaps = append(gaps, time.Duration(i)*time.Millisecond+123*time.Microsecond)
	}
	if got := *p95Millis(gaps); got != 20.12 {
		t.Fatalf("p95 %v ms, want 20.12 (the largest of 20: int(0.95*20) = 19)", got)
	}
	if p95Millis(nil) != nil {
		t.Fatal("no gaps: null")
	}
}

const loggedTable = `{"version":1,"models":{"m":{"route":"decode","parityHash":"abc",` +
	`"groups":[{"prefill":[],"decode":["URL"]}]}},"requestLog":{"routes":{"pd":"openai_pd",` +
	`"decode":"aggregated","render_pd":"render_pd","render_decode":"render"},"names":{"URL":"decode-0"}}}`

// What the data plane served is logged as the Python gateway logs it: an answer with its
// usage, a stream with its first token; a request answered with an error is not.
func TestTheDataPlaneLogsTheRequestsItServes(t *testing.T) {
	reader, writer, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reader.Close() })
	engine := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch {
		case strings.Contains(string(body), `"refuse"`):
			w.WriteHeader(http.StatusBadRequest)
			io.WriteString(w, `{"error":{"message":"no"}}`)
		case strings.Contains(string(body), `"stream":true`):
			w.Header().Set("Content-Type", "text/event-stream")
			for _, text := range []string{"a", "b", "c"} {
				io.WriteString(w, `data: {"choices":[{"index":0,"delta":{"content":"`+text+`"},"finish_reason":null}]}`+"\n\n")
				w.(http.Flusher).Flush()
			}
			io.WriteString(w, `data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`+"\n\ndata: [DONE]\n\n")
		default:
			io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}],`+
				`"usage":{"prompt_tokens":7,"completion_tokens":3}}`)
		}
	}
	var sink *requestLog
	u := newPlaneUnderTest(t, loggedTable, engine, func(p *plane) {
		sink = newRequestLog(writer)
		p.requestLog = sink
	})
	answer, _ := u.post(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`,
		"X-Request-Id", "mine-1")
	refused, _ := u.post(t, `{"model":"m","messages":[{"role":"user","content":"refuse"}]}`)
	streamed, _ := u.post(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,`+
		`"max_completion_tokens":9}`, "X-PDServe-Class", "document")
	if answer.StatusCode != 200 || refused.StatusCode != 400 || streamed.StatusCode != 200 {
		t.Fatalf("statuses %d %d %d", answer.StatusCode, refused.StatusCode, streamed.StatusCode)
	}
	lines := bufio.NewReader(reader)
	first, second := readEntry(t, lines), readEntry(t, lines)
	sink.close()
	_ = writer.Close()
	if rest, _ := io.ReadAll(lines); len(rest) != 0 {
		t.Fatalf("one entry too many (the refused request): %s", rest)
	}
	want := map[string]any{"request_id": answer.Header.Get("X-PDServe-Request-Id"),
		"client_request_id": "mine-1", "class": "chat", "route": "aggregated",
		"prompt_tokens": 7.0, "output_tokens": 3.0, "requested_output_tokens": 5.0,
		"inter_token_ms_p95": nil, "render_engine": nil, "prefill_engine": nil,
		"decode_engine": "decode-0", "parity_hash": "abc", "auto_reason": nil}
	for key, value := range want {
		if first[key] != value {
			t.Errorf("answer's %s = %v, want %v", key, first[key], value)
		}
	}
	if first["first_token_at_ms"] != first["finished_at_ms"] {
		t.Errorf("a whole answer's first token is its end: %v", first)
	}
	want = map[string]any{"request_id": streamed.Header.Get("X-PDServe-Request-Id"),
		"client_request_id": nil, "class": "document", "prompt_tokens": nil, "output_tokens": nil,
		"requested_output_tokens": 9.0, "decode_engine": "decode-0"}
	for key, value := range want {
		if second[key] != value {
			t.Errorf("stream's %s = %v, want %v", key, second[key], value)
		}
	}
	sent, firstToken, end := second["sent_at_ms"].(float64), second["first_token_at_ms"].(float64), second["finished_at_ms"].(float64)
	if !(sent <= firstToken && firstToken <= end) {
		t.Errorf("a stream's times: %v", second)
	}
}

func readEntry(t *testing.T, lines *bufio.Reader) map[string]any {
	t.Helper()
	line, err := lines.ReadBytes('\n')
	if err != nil {
		t.Fatal(err)
	}
	var entry map[string]any
	if err := json.Unmarshal(line, &entry); err != nil {
		t.Fatalf("%q: %v", line, err)
	}
	return entry
}
