package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// validationCase: one of testdata/validation_cases.json, which the Python gateway's own test
// (tests/unit/gateway/test_validation_cases.py) reads too.
type validationCase struct {
	Name    string            `json:"name"`
	Path    string            `json:"path"`
	Headers map[string]string `json:"headers"`
	Body    string            `json:"body"`
	Param   *string           `json:"param"`
}

func validationCases(t testing.TB) map[string][]validationCase {
	return sharedCases[map[string][]validationCase](t, "validation_cases.json")
}

func (c validationCase) proven(t testing.TB) bool {
	r, _ := http.NewRequest(http.MethodPost, "http://x"+c.Path, strings.NewReader(c.Body))
	for name, value := range c.Headers {
		r.Header.Set(name, value)
	}
	members, err := topLevel([]byte(c.Body))
	if err != nil {
		t.Fatalf("%s: the fast path's reader refuses the body (%v): the case tests nothing", c.Name, err)
	}
	return provablyValid(r, []byte(c.Body), members, c.Path == "/v1/chat/completions")
}

func TestTheFastPathServesNoRequestThePythonGatewayRefusesAndTheValidOnes(t *testing.T) {
	cases := validationCases(t)
	if len(cases["refused"]) < 15 || len(cases["accepted"]) < 3 {
		t.Fatalf("too few cases: %d refused, %d accepted", len(cases["refused"]), len(cases["accepted"]))
	}
	for _, c := range append(cases["refused"], cases["handed_over"]...) {
		if c.proven(t) {
			t.Errorf("%s: served by the fast path, where the Python gateway answers 400 (param %v)", c.Name, c.Param)
		}
	}
	for _, c := range cases["accepted"] {
		if !c.proven(t) {
			t.Errorf("%s: handed over, though valid: the fast path loses it", c.Name)
		}
	}
}

// A typical 2 KB chat body: what the fast path's check costs per request.
func BenchmarkProvablyValidChat2KB(b *testing.B) {
	body := []byte(`{"model":"qwen","messages":[{"role":"system","content":"You are a helpful assistant."},` +
		`{"role":"user","content":"` + strings.Repeat("Tell me about the weather in Paris. ", 50) + `"}],` +
		`"max_tokens":256,"temperature":0.7,"top_p":0.95,"stream":true,"stream_options":{"include_usage":true}}`)
	r, _ := http.NewRequest(http.MethodPost, "http://x/v1/chat/completions", nil)
	r.Header.Set("Content-Type", "application/json")
	members, err := topLevel(body)
	if err != nil || !provablyValid(r, body, members, true) {
		b.Fatal("the benchmark's body is not proven valid")
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for range b.N {
		provablyValid(r, body, members, true)
	}
}

// Whatever the fast path proves valid is JSON (Python's reader would read it), whatever the
// client sent; and neither the validation nor a stream's event check ever panics on bytes from
// a peer.
func FuzzWhatThePeersSendIsReadSafely(f *testing.F) {
	for _, cases := range validationCases(f) {
		for _, c := range cases {
			f.Add([]byte(c.Body))
		}
	}
	f.Add([]byte(`{"choices":[{"index":0,"finish_reason":null,"delta":{"content":"x"}}]}`))
	f.Add([]byte(`{"error":{"message":"m","code":500}}`))
	f.Add([]byte(`[DONE]`))
	r, _ := http.NewRequest(http.MethodPost, "http://x/v1/chat/completions", nil)
	f.Fuzz(func(t *testing.T, body []byte) {
		var events eventCheck
		events.check(body)
		members, err := topLevel(body)
		if err != nil {
			return
		}
		for _, chat := range []bool{true, false} {
			if provablyValid(r, body, members, chat) && !json.Valid(body) {
				t.Fatalf("proven valid, yet not JSON: %q", body)
			}
		}
	})
}
