package main

// Refusals both request paths answer before any engine call, worded as the Python gateway
// words them (errors.gateway_owned_refused, over_cap, tokenizer_needed,
// stream_logprobs_refused), and what triggers them read as it reads it
// (openai_schema.gateway_owned, needs_tokenizer, logprobs_asked), held together by
// testdata/refusals.json (refusals_test.go, tests/unit/gateway/test_refusal_cases.py).

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// tooLarge: a body over -max-body-bytes (declared, or as it arrived).
func tooLarge(limit int64) *failure {
	return gatewayError(http.StatusRequestEntityTooLarge, "RequestTooLarge",
		"request body exceeds "+strconv.FormatInt(limit, 10)+" bytes")
}

// overCap: a completion limit over --max-tokens-cap.
func overCap(field string, limit int64) *failure {
	f := gatewayError(http.StatusBadRequest, "BadRequestError",
		field+" may be at most "+strconv.FormatInt(limit, 10))
	f.param = field
	return f
}

// gatewayOwned: what only the gateway may send an engine (kv_transfer_params, ec_transfer_params:
// where to pull or hand off a request's KV or encoder cache), as openai_schema.gateway_owned
// reads it. vLLM reads them from the request or from vllm_xargs, and a render server passes both
// on: from a client they would point an engine at any host, or hold its KV blocks. unsure: a
// vllm_xargs this reader cannot read as Python does (a key given twice): the Python gateway's.
func gatewayOwned(members []member) (param string, unsure bool) {
	for _, key := range gatewayOwnedParams {
		if present(members, key) {
			return key, false
		}
	}
	xargs := lookup(members, "vllm_xargs")
	if !isObject(xargs) {
		return "", false // null, or something vLLM itself refuses
	}
	fields, err := topLevel(xargs)
	if err != nil || duplicated(fields) {
		return "", true
	}
	for _, key := range gatewayOwnedParams {
		if present(fields, key) {
			return "vllm_xargs." + key, false
		}
	}
	return "", false
}

var gatewayOwnedParams = []string{"kv_transfer_params", "ec_transfer_params"}

// gatewayOwnedRefused: a client setting what only the gateway may.
func gatewayOwnedRefused(param string) *failure {
	f := gatewayError(http.StatusBadRequest, "BadRequestError", param+
		" is the gateway's to set (it hands KV between the engines itself): remove it from the request")
	f.param = param
	return f
}

// tokenizerNeeded is openai_schema.needs_tokenizer over a validated body: the first parameter
// a --tokens-only engine would refuse (it needs a tokenizer), "" when none.
func tokenizerNeeded(members []member, chat bool) string {
	if stop := lookup(members, "stop"); stop != nil && !isNull(stop) && !emptyArray(stop) {
		return "stop"
	}
	if structuredFormat(lookup(members, "response_format")) {
		return "response_format"
	}
	if present(members, "structured_outputs") {
		return "structured_outputs"
	}
	for _, guided := range guidedParams {
		if present(members, guided) {
			return guided
		}
	}
	if chat && string(lookup(members, "tool_choice")) == `"required"` {
		return "tool_choice"
	}
	return ""
}

// structuredFormat: a (validated) response_format whose type vLLM serves with structured
// outputs (openai_schema.STRUCTURED_FORMATS; "text" is none).
func structuredFormat(raw []byte) bool {
	if !isObject(raw) {
		return false
	}
	fields, err := topLevel(raw)
	var kind string
	if err != nil || json.Unmarshal(lookup(fields, "type"), &kind) != nil {
		return false
	}
	return kind == "json_schema" || kind == "json_object" || kind == "structural_tag"
}

// guidedParams: vLLM's older structured-output parameters (openai_schema.GUIDED_PARAMS).
var guidedParams = []string{"guided_json", "guided_regex", "guided_choice", "guided_grammar"}

// tokenizerTasks: per parameter, what the engine would have to do for it and what a client can
// send instead (openai_schema.needs_tokenizer's NeedsTokenizer).
var tokenizerTasks = map[string][2]string{
	"stop":               {"apply stop strings", "use stop_token_ids"},
	"response_format":    {structuredTask, `use response_format type "text"`},
	"structured_outputs": {structuredTask, "drop structured_outputs"},
	"tool_choice": {"force a tool call (vLLM forces one with structured outputs, which need a tokenizer)",
		`use tool_choice "auto"`},
}

const structuredTask = "apply structured outputs (they need a tokenizer)"

// tokenizerRefused: a parameter the model's --tokens-only engines would refuse.
func tokenizerRefused(param string) *failure {
	task, ok := tokenizerTasks[param]
	if !ok { // a guided_* parameter
		task = [2]string{structuredTask, "drop " + param}
	}
	f := gatewayError(http.StatusBadRequest, "BadRequestError", param+
		" is not available on this model: its engines run --tokens-only (spec.render.engineApi: "+
		"TokensOnly), which cannot "+task[0]+"; "+task[1]+", or set spec.render.engineApi: ScaleOut")
	f.param = param
	return f
}

// streamLogprobsRefused: a stream behind render servers asking for log probabilities (a
// streamed choice is derendered from its token ids alone: they would be dropped).
func streamLogprobsRefused(param string) *failure {
	f := gatewayError(http.StatusBadRequest, "BadRequestError", param+
		" is not available with stream: true on this model (its render servers derender "+
		"streamed tokens without their log probabilities); send stream: false to get them")
	f.param = param
	return f
}

// capDrops: a body's max_tokens, replaced by the cap when the request set no limit.
var capDrops = map[string]bool{"max_tokens": true}

// capLimits is intake.py's --max-tokens-cap: the field of the route's limits over the cap
// (max_tokens first), or, when it set none, fill (max_tokens = the cap is sent on). Only the
// route's own fields count: max_completion_tokens is a chat field, which vLLM ignores on
// /v1/completions. readable false: a limit that is no integer (validation proved it one; kept
// for safety: the Python gateway answers it).
func capLimits(members []member, limit int64, chat bool) (over string, fill, readable bool) {
	keys := []string{"max_tokens"}
	if chat {
		keys = append(keys, "max_completion_tokens")
	}
	fill = true
	for _, key := range keys {
		raw := lookup(members, key)
		if raw == nil || string(raw) == "null" {
			continue
		}
		fill = false
		value, err := strconv.ParseInt(string(raw), 10, 64)
		if err != nil {
			return "", false, false
		}
		if value > limit && over == "" {
			over = key
		}
	}
	return over, fill && over == "", true
}

// logprobsAsked is openai_schema.logprobs_asked: the parameter of a (validated) body that asks
// for log probabilities, if any.
func logprobsAsked(members []member, chat bool) string {
	if chat {
		top, _ := jsonInt(lookup(members, "top_logprobs"))
		if string(lookup(members, "logprobs")) == "true" || top > 0 {
			return "logprobs"
		}
	} else if present(members, "logprobs") {
		return "logprobs"
	}
	if present(members, "prompt_logprobs") {
		return "prompt_logprobs"
	}
	return ""
}

// present: the body sets `key` to something other than null (Python's `is not None`).
func present(members []member, key string) bool {
	raw := lookup(members, key)
	return raw != nil && !isNull(raw)
}
