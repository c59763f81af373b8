package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// intakeStub stands in for the Python gateway's intake: what it was asked, and its answer.
type intakeStub struct {
	mu       sync.Mutex
	asked    []string
	headers  []http.Header
	status   int
	answer   string
	noHeader bool // an answer that is not the intake's (a gateway without one)
}

func (s *intakeStub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	s.mu.Lock()
	s.asked = append(s.asked, r.URL.Path+" "+string(body))
	s.headers = append(s.headers, r.Header.Clone())
	s.mu.Unlock()
	if !s.noHeader {
		w.Header().Set(intakeHeader, "1")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(s.status)
	io.WriteString(w, s.answer)
}

// engineEcho answers with the body it was sent, as the answer's one choice's text.
type engineEcho struct {
	mu   sync.Mutex
	seen []string
}

func (e *engineEcho) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	e.mu.Lock()
	e.seen = append(e.seen, string(body))
	e.mu.Unlock()
	io.WriteString(w, `{"choices":[{"index":0,"message":{"content":"ok"},"finish_reason":"stop"}]}`)
}

func planeWithIntake(t *testing.T, stub *intakeStub, engine *engineEcho) *planeUnderTest {
	t.Helper()
	intake := httptest.NewServer(stub)
	t.Cleanup(intake.Close)
	return newPlaneUnderTest(t, decodeTable, engine.ServeHTTP, func(p *plane) {
		p.intake = &intakeClient{base: intake.URL, token: testToken, client: http.DefaultClient, limit: 1 << 20}
	})
}

// A body the data plane cannot read as the engines would (a member given twice) is read by the
// Python gateway's intake; the data plane serves the body the intake wrote, itself.
func TestWhatTheIntakeAcceptsTheDataPlaneServesAsTheIntakeWroteIt(t *testing.T) {
	canonical := `{"model":"m","messages":[{"role":"user","content":"second"}],"max_tokens":7}`
	stub := &intakeStub{status: 200, answer: canonical}
	engine := &engineEcho{}
	u := planeWithIntake(t, stub, engine)
	sent := `{"model":"m","messages":[{"role":"user","content":"first"}],` +
		`"messages":[{"role":"user","content":"second"}]}`
	answer, text := u.post(t, sent, "Authorization", "Bearer k", "X-Request-Id", "r")
	if answer.StatusCode != 200 || !strings.Contains(text, `"ok"`) {
		t.Fatalf("%d %s", answer.StatusCode, text)
	}
	if len(stub.asked) != 1 || stub.asked[0] != "/_pdserve/dataplane/intake/v1/chat/completions "+sent {
		t.Fatalf("the intake was asked %q", stub.asked)
	}
	if h := stub.headers[0]; h.Get(tokenHeader) != testToken || h.Get("Authorization") != "Bearer k" ||
		h.Get("X-Request-Id") != "" {
		t.Fatalf("the intake's headers: %v", h)
	}
	if len(engine.seen) != 1 || engine.seen[0] != canonical {
		t.Fatalf("decode was sent %q, want the intake's body", engine.seen)
	}
	if len(u.python.seen()) != 0 || u.p.stats.intake.Load() != 1 {
		t.Fatalf("handed over %d, intake count %d", len(u.python.seen()), u.p.stats.intake.Load())
	}
}

// What the intake refuses, the client gets in its words, counted as refused before any
// engine call; no engine is asked.
func TestWhatTheIntakeRefusesTheClientGetsInItsWords(t *testing.T) {
	refusal := `{"error":{"message":"temperature: must be >= 0","type":"BadRequestError","param":"temperature","code":400}}`
	stub := &intakeStub{status: 400, answer: refusal}
	engine := &engineEcho{}
	u := planeWithIntake(t, stub, engine)
	answer, text := u.post(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":-1}`)
	if answer.StatusCode != 400 || text != refusal {
		t.Fatalf("%d %s", answer.StatusCode, text)
	}
	if len(engine.seen) != 0 || len(u.python.seen()) != 0 || requests(u.p, "unknown", "error_400") != 1 {
		t.Fatalf("engine %d, handed over %d, counted %d", len(engine.seen), len(u.python.seen()),
			requests(u.p, "unknown", "error_400"))
	}
}

// An intake that cannot be asked (the Python gateway crashed, or answers as something else):
// the client is told to retry, with Retry-After; the request is neither served unchecked nor
// handed over.
func TestAnIntakeThatCannotBeAskedIsA503TheClientMayRetry(t *testing.T) {
	stub := &intakeStub{status: 404, answer: `{"error":{"message":"Not Found"}}`, noHeader: true}
	engine := &engineEcho{}
	u := planeWithIntake(t, stub, engine)
	answer, text := u.post(t, `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":-1}`)
	want := `{"error":{"message":"the gateway could not check this request now: retry shortly",` +
		`"type":"ServiceUnavailableError","param":null,"code":503}}`
	if answer.StatusCode != 503 || text != want || answer.Header.Get("Retry-After") != "1" {
		t.Fatalf("%d %s", answer.StatusCode, text)
	}
	if len(engine.seen) != 0 || len(u.python.seen()) != 0 || requests(u.p, "unknown", "error_503") != 1 {
		t.Fatalf("engine %d, handed over %d, counted %d", len(engine.seen), len(u.python.seen()),
			requests(u.p, "unknown", "error_503"))
	}
}
