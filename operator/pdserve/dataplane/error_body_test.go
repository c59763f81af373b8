package main

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

// errorBodyCase: one of testdata/error_bodies.json, which the Python gateway's test
// (tests/unit/gateway/test_error_bodies.py) reads too: an error answer's body, byte for byte.
type errorBodyCase struct {
	sharedError
	Name string `json:"name"`
	Body string `json:"body"`
}

func TestAnErrorAnswerIsTheBodyThePythonGatewayWrites(t *testing.T) {
	for _, c := range sharedCases[[]errorBodyCase](t, "error_bodies.json") {
		want := c.failure()
		if got := string(errorBody(c.Status, c.Type, c.Message, want.param)); got != c.Body {
			t.Errorf("%s:\n got %s\nwant %s", c.Name, got, c.Body)
		}
		// The answer as a whole, for the errors the data plane answers before any engine call.
		recorder := httptest.NewRecorder()
		answerFailure(recorder, &served{}, want)
		if recorder.Code != c.Status || recorder.Body.String() != c.Body {
			t.Errorf("%s: answered %d %s", c.Name, recorder.Code, recorder.Body.String())
		}
		if ct := recorder.Header().Get("Content-Type"); ct != "application/json" {
			t.Errorf("%s: Content-Type %q", c.Name, ct)
		}
		if c.Param == nil {
			recorder = httptest.NewRecorder()
			answerError(recorder, c.Status, c.Type, c.Message, false)
			retry := recorder.Header().Get("Retry-After")
			wantRetry := map[bool]string{true: "1", false: ""}[c.Status == 429 || c.Status == 503]
			if recorder.Body.String() != c.Body || retry != wantRetry {
				t.Errorf("%s: answerError wrote %s (Retry-After %q)", c.Name, recorder.Body.String(), retry)
			}
		}
	}
}

// A model the table does not serve is refused by the data plane itself, in the Python
// gateway's words, before any engine or the Python gateway hears of it, and counted as the
// Python gateway counts it.
func TestAnUnknownModelIsAnsweredHereWithTheSharedBody(t *testing.T) {
	var engineCalls atomic.Int64
	u := newPlaneUnderTest(t, decodeTable, func(w http.ResponseWriter, _ *http.Request) {
		engineCalls.Add(1)
	}, nil)
	var want string
	for _, c := range sharedCases[[]errorBodyCase](t, "error_bodies.json") {
		if c.Name == "unknown model" {
			want = c.Body
		}
	}
	response, text := u.post(t, `{"model":"gpt-4","messages":[{"role":"user","content":"hi"}]}`)
	if response.StatusCode != http.StatusNotFound || text != want {
		t.Fatalf("answered %d %s, want 404 %s", response.StatusCode, text, want)
	}
	if len(u.python.arrived) != 0 || engineCalls.Load() != 0 {
		t.Fatalf("handed over %d times, %d engine calls: want neither", len(u.python.arrived), engineCalls.Load())
	}
	if n := requests(u.p, "unknown", "error_404"); n != 1 {
		t.Fatalf("counted %d as unknown/error_404, want 1", n)
	}
}
