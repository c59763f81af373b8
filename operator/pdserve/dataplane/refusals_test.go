package main

import (
	"encoding/json"
	"net/http/httptest"
	"testing"
)

// refusalCase is one of testdata/refusals.json, which the Python gateway's tests read too
// (tests/unit/gateway/test_refusal_cases.py).
type refusalCase struct {
	Name    string          `json:"name"`
	Refusal string          `json:"refusal"`
	Chat    bool            `json:"chat"`
	Body    json.RawMessage `json:"body"`
	Field   string          `json:"field"`
	Cap     int64           `json:"cap"`
	sharedError
}

func TestARefusalIsWordedAsTheSharedCaseSays(t *testing.T) {
	for _, c := range sharedCases[[]refusalCase](t, "refusals.json") {
		var f *failure
		switch c.Refusal {
		case "too_large":
			f = tooLarge(c.Cap)
		case "over_cap":
			f = overCap(c.Field, c.Cap)
		case "stream_logprobs":
			f = streamLogprobsRefused(c.Field)
		case "needs_tokenizer", "gateway_owned":
			members, err := topLevel(c.Body)
			if err != nil || !provablyValid(httptest.NewRequest("POST", "/", nil), c.Body, members, c.Chat) {
				t.Fatalf("%s: the case's body is not one the data plane serves (%v)", c.Name, err)
			}
			var param string
			refuse := tokenizerRefused // what a model whose engines run --tokens-only refuses
			if c.Refusal == "needs_tokenizer" {
				param = tokenizerNeeded(members, c.Chat)
			} else {
				param, _ = gatewayOwned(members)
				refuse = gatewayOwnedRefused
			}
			if c.Status == 0 {
				if param != "" {
					t.Errorf("%s: refused for %s, want served", c.Name, param)
				}
				continue
			}
			f = refuse(param)
		default:
			t.Fatalf("%s: refusal %q", c.Name, c.Refusal)
		}
		want := c.failure()
		if f.status != want.status || f.kind != want.kind || f.param != want.param || f.message != want.message {
			t.Errorf("%s: got %d %s %s %q", c.Name, f.status, f.kind, f.param, f.message)
		}
	}
}

func TestLogprobsAreAskedAsThePythonGatewayReadsThem(t *testing.T) {
	for body, want := range map[string]string{
		`{"logprobs":true}`: "logprobs", `{"logprobs":false}`: "", `{"top_logprobs":2}`: "logprobs",
		`{"top_logprobs":0}`: "", `{"prompt_logprobs":0}`: "prompt_logprobs", `{"prompt_logprobs":null}`: "",
	} {
		members, _ := topLevel([]byte(body))
		if got := logprobsAsked(members, true); got != want {
			t.Errorf("chat %s: %q, want %q", body, got, want)
		}
	}
	for body, want := range map[string]string{
		`{"logprobs":0}`: "logprobs", `{"logprobs":null}`: "", `{}`: "",
	} {
		members, _ := topLevel([]byte(body))
		if got := logprobsAsked(members, false); got != want {
			t.Errorf("completion %s: %q, want %q", body, got, want)
		}
	}
}

func TestAVllmXargsReadTwoWaysIsLeftToThePythonGateway(t *testing.T) {
	// Python's reader keeps the last of a key given twice: a null first must not hide it.
	body := []byte(`{"vllm_xargs":{"kv_transfer_params":null,"kv_transfer_params":{"remote_host":"h"}}}`)
	members, _ := topLevel(body)
	if param, unsure := gatewayOwned(members); param != "" || !unsure {
		t.Fatalf("gatewayOwned = %q, %v: want it handed to the Python gateway", param, unsure)
	}
}
