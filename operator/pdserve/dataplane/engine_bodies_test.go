package main

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strconv"
	"testing"
)

// engineBodyCases is testdata/engine_bodies.json, which the Python gateway's tests read too
// (tests/unit/vllm/test_engine_body_cases.py): the engine requests each route sends.
type engineBodyCases struct {
	TokensPrefill []engineBodyCase `json:"tokensPrefill"`
	TokensDecode  []engineBodyCase `json:"tokensDecode"`
	OpenAIPrefill []engineBodyCase `json:"openaiPrefill"`
	OpenAIDecode  []engineBodyCase `json:"openaiDecode"`
	Derender      []engineBodyCase `json:"derender"`
	Corrections   []engineBodyCase `json:"corrections"`
}

type engineBodyCase struct {
	Name       string          `json:"name"`
	Generate   json.RawMessage `json:"generate"`
	Request    json.RawMessage `json:"request"`
	KV         json.RawMessage `json:"kv"`
	Chat       bool            `json:"chat"`
	Model      string          `json:"model"`
	Answer     json.RawMessage `json:"answer"`
	Params     json.RawMessage `json:"params"`
	PromptIDs  json.RawMessage `json:"promptIds"`
	Derendered json.RawMessage `json:"derendered"`
	Want       json.RawMessage `json:"want"`
}

func members(t *testing.T, raw []byte) []member {
	t.Helper()
	fields, err := topLevel(raw)
	if err != nil {
		t.Fatalf("not an object: %s", raw)
	}
	return fields
}

func sameValue(t *testing.T, got []byte, want json.RawMessage) {
	t.Helper()
	if !reflect.DeepEqual(parsed(t, got), parsed(t, want)) {
		t.Fatalf("\n got %s\nwant %s", got, want)
	}
}

// kvOrNil: a case's kv, nil when it says null (decode prefills itself).
func kvOrNil(raw json.RawMessage) []byte {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	return raw
}

// rendered: a rendered generate request as the route reads it (its request id is the
// gateway's, written by the route).
func rendered(t *testing.T, generate []byte) (fields []member, params []byte, paramFields []member, quotedID []byte) {
	t.Helper()
	fields = members(t, generate)
	params = lookup(fields, "sampling_params")
	return fields, params, members(t, params), lookup(fields, "request_id")
}

func TestEngineRequestsAreTheSharedCases(t *testing.T) {
	cases := sharedCases[engineBodyCases](t, "engine_bodies.json")
	for _, c := range cases.TokensPrefill {
		t.Run("tokens prefill: "+c.Name, func(t *testing.T) {
			fields, params, paramFields, id := rendered(t, c.Generate)
			var got bytes.Buffer
			tokensPrefillBody(&got, c.Generate, fields, params, paramFields, handoff, id)
			sameValue(t, got.Bytes(), c.Want)
		})
	}
	for _, c := range cases.TokensDecode {
		t.Run("tokens decode: "+c.Name, func(t *testing.T) {
			fields, params, paramFields, id := rendered(t, c.Generate)
			var got bytes.Buffer
			tokensDecodeBody(&got, c.Generate, fields, params, paramFields, id, kvOrNil(c.KV))
			sameValue(t, got.Bytes(), c.Want)
		})
	}
	for _, c := range cases.OpenAIPrefill {
		t.Run("openai prefill: "+c.Name, func(t *testing.T) {
			var got bytes.Buffer
			openaiPrefillBody(&got, c.Request, members(t, c.Request), handoff)
			sameValue(t, got.Bytes(), c.Want)
		})
	}
	for _, c := range cases.OpenAIDecode {
		t.Run("openai decode: "+c.Name, func(t *testing.T) {
			var got bytes.Buffer
			openaiDecodeBody(&got, c.Request, members(t, c.Request), kvOrNil(c.KV))
			sameValue(t, got.Bytes(), c.Want)
		})
	}
}

func TestDerenderRequestsAndCorrectionsAreTheSharedCases(t *testing.T) {
	cases := sharedCases[engineBodyCases](t, "engine_bodies.json")
	for _, c := range cases.Derender {
		t.Run("derender: "+c.Name, func(t *testing.T) {
			includeStop := string(lookup(members(t, c.Params), "include_stop_str_in_output")) == "true"
			var trimmed, got bytes.Buffer
			generated, _ := withoutStopTokens(&trimmed, c.Answer, members(t, c.Answer), includeStop)
			model := strconv.AppendQuote(nil, c.Model)
			derenderBody(&got, c.Chat, model, generated, countElements(c.PromptIDs), c.PromptIDs, c.Request)
			sameValue(t, got.Bytes(), c.Want)
		})
	}
	for _, c := range cases.Corrections {
		t.Run("corrections: "+c.Name, func(t *testing.T) {
			answer := members(t, c.Answer)
			includeStop := string(lookup(members(t, c.Params), "include_stop_str_in_output")) == "true"
			var trimmed, got bytes.Buffer
			_, stops := withoutStopTokens(&trimmed, c.Answer, answer, includeStop)
			toolChoice := lookup(members(t, c.Request), "tool_choice")
			namedTool := len(toolChoice) > 0 && toolChoice[0] == '{'
			matchVllmServe(&got, c.Derendered, members(t, c.Derendered), lookup(answer, "usage"), stops,
				c.Chat, namedTool, []byte(`"m"`), []byte(`"pdserve-1"`))
			sameValue(t, got.Bytes(), c.Want)
		})
	}
}
