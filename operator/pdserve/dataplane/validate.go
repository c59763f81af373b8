package main

// Which requests the fast path may serve without the Python gateway's validation. The Python
// gateway (intake.py, openai_schema.validate_request) is the one place a request is refused,
// with a 400 naming the parameter; the data plane serves only what it can prove that
// validation accepts with cheap checks of the bytes, and hands every other request over, where
// it is served or refused as if the data plane were not there. The two are pinned together by
// testdata/validation_cases.json (validate_test.go, tests/unit/gateway/test_validation_cases.py).

import (
	"bytes"
	"encoding/binary"
	"math"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"
)

const clientIDLimit = 256 // exchange.CLIENT_ID_LIMIT

// provablyValid: the request's headers and body (its top-level members) pass the Python
// gateway's validation; false means "not proven", never "invalid".
func provablyValid(r *http.Request, body []byte, members []member, chat bool) bool {
	if len(r.Header.Get("X-Request-Id")) > clientIDLimit || !utf8Charset(r.Header.Get("Content-Type")) {
		return false
	}
	if !utf8.Valid(body) || !readableJSON(body) {
		return false // Python's decode or JSON reader refuses it, naming the fault
	}
	n, bestOf := int64(1), int64(0)
	logprobs, topLogprobs := false, int64(0)
	required := false
	for i := range members {
		v := members[i].value
		ok := true
		switch members[i].key {
		case "model", "user":
			ok = isNull(v) || isString(v)
		case "stream", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
			"include_stop_str_in_output", "echo":
			ok = isNull(v) || isBool(v)
		case "max_tokens":
			ok = isNull(v) || intAtLeast(v, 1)
		case "n":
			ok = isNull(v) || intAtLeast(v, 1)
			if ok && !isNull(v) {
				n, _ = jsonInt(v)
			}
		case "best_of":
			ok = isNull(v) || intAtLeast(v, 1)
			if ok && !isNull(v) {
				bestOf, _ = jsonInt(v)
			}
		case "temperature":
			ok = isNull(v) || numberWithin(v, 0, math.Inf(1), false)
		case "top_p":
			ok = isNull(v) || numberWithin(v, 0, 1, true)
		case "min_p":
			ok = isNull(v) || numberWithin(v, 0, 1, false)
		case "presence_penalty", "frequency_penalty":
			ok = isNull(v) || numberWithin(v, -2, 2, false)
		case "repetition_penalty":
			ok = isNull(v) || numberWithin(v, 0, math.Inf(1), true)
		case "top_k", "prompt_logprobs", "truncate_prompt_tokens":
			ok = isNull(v) || intAtLeast(v, -1)
		case "min_tokens":
			ok = isNull(v) || intAtLeast(v, 0)
		case "seed", "priority":
			ok = isNull(v) || intAtLeast(v, math.MinInt64+1)
		case "conversation_id":
			ok = isNull(v) || isString(v) || intAtLeast(v, math.MinInt64+1)
		case "stop":
			ok = isNull(v) || isString(v) || allItems(v, isString)
		case "stop_token_ids":
			ok = isNull(v) || allItems(v, func(item []byte) bool { return intAtLeast(item, math.MinInt64+1) })
		case "stream_options":
			ok = isNull(v) || streamOptions(v)
		case "structured_outputs":
			ok = isNull(v) || isObject(v)
		case "response_format":
			ok = isNull(v) || responseFormat(v)
		case "logit_bias", "prompt_embeds":
			ok = isNull(v) // more than a cheap check: the Python gateway's
		default:
			if chat {
				ok, required, logprobs, topLogprobs = chatMember(members[i].key, v, required, logprobs, topLogprobs)
			} else {
				ok, required = completionMember(members[i].key, v, required)
			}
		}
		if !ok {
			return false
		}
	}
	if bestOf != 0 && bestOf < n || topLogprobs > 0 && !logprobs {
		return false
	}
	// The members' reader finds where each value ends, not whether it is JSON (`"x": A`):
	// Python's reader refuses what is not, whichever member it is in.
	return required // messages, or a prompt
}

func chatMember(key string, v []byte, required, logprobs bool, top int64) (bool, bool, bool, int64) {
	ok := true
	switch key {
	case "messages":
		ok = !isNull(v) && allItems(v, message) && !emptyArray(v)
		required = ok
	case "max_completion_tokens":
		ok = isNull(v) || intAtLeast(v, 1)
	case "logprobs":
		ok = isNull(v) || isBool(v)
		logprobs = string(v) == "true"
	case "top_logprobs":
		ok = isNull(v) || intAtLeast(v, -1)
		if ok && !isNull(v) {
			top, _ = jsonInt(v)
		}
	case "parallel_tool_calls", "add_generation_prompt", "continue_final_message":
		ok = isNull(v) || isBool(v)
	case "chat_template", "reasoning_effort":
		ok = isNull(v) || isString(v)
	case "chat_template_kwargs":
		ok = isNull(v) || isObject(v)
	case "tools":
		ok = isNull(v) || allItems(v, tool)
	case "tool_choice":
		s := string(v)
		ok = s == "null" || s == `"none"` || s == `"auto"` || s == `"required"`
	}
	return ok, required, logprobs, top
}

func completionMember(key string, v []byte, required bool) (bool, bool) {
	ok := true
	switch key {
	case "prompt":
		ok = isString(v) || allItems(v, isString) || allItems(v, func(item []byte) bool {
			return intAtLeast(item, math.MinInt64+1)
		})
		required = ok
	case "suffix":
		ok = isNull(v) || isString(v)
	case "logprobs":
		ok = isNull(v) || intAtLeast(v, -1)
	}
	return ok, required
}

// message: {"role": string, "content": string | [objects] | null, name, tool_call_id: string,
// tool_calls: [objects]}.
func message(v []byte) bool {
	role := false
	return forPlainMembers(v, func(key, value []byte) bool {
		switch string(key) {
		case "role":
			role = isString(value)
			return role
		case "content":
			return isNull(value) || isString(value) || allItems(value, isObject)
		case "name", "tool_call_id":
			return isNull(value) || isString(value)
		case "tool_calls":
			return isNull(value) || allItems(value, isObject)
		}
		return true
	}) && role
}

// tool: {"type": string, "function": {"name": string, "description": string, "parameters": object}}.
func tool(v []byte) bool {
	function := false
	return forPlainMembers(v, func(key, value []byte) bool {
		switch string(key) {
		case "type":
			return isString(value)
		case "function":
			function = namedObject(value, "name", map[string]func([]byte) bool{
				"description": isString, "parameters": isObject})
			return function
		}
		return true
	}) && function
}

// namedObject: an object whose `name` member is a string and whose `optional` members are
// null or pass their check (others are the engine's to read).
func namedObject(v []byte, name string, optional map[string]func([]byte) bool) bool {
	named := false
	return forPlainMembers(v, func(key, value []byte) bool {
		if string(key) == name {
			named = isString(value)
			return named
		}
		if check, ok := optional[string(key)]; ok {
			return isNull(value) || check(value)
		}
		return true
	}) && named
}

func streamOptions(v []byte) bool {
	return forPlainMembers(v, func(key, value []byte) bool {
		switch string(key) {
		case "include_usage", "continuous_usage_stats":
			return isNull(value) || isBool(value)
		}
		return true
	})
}

// responseFormat: openai_schema.ResponseFormat, an object whose type is a string and whose
// json_schema, if any, an object (what it holds is the engine's to read).
func responseFormat(v []byte) bool {
	if !namedObject(v, "type", map[string]func([]byte) bool{"json_schema": isObject}) {
		return false
	}
	fields, err := topLevel(v) // a key given twice: Python keeps the last, this reader the first
	return err == nil && !duplicated(fields)
}

// utf8Charset: no charset, or UTF-8's (the Python gateway decodes any other, or refuses it).
func utf8Charset(contentType string) bool {
	_, params, found := strings.Cut(contentType, ";")
	if !found {
		return true
	}
	params = strings.ToLower(strings.TrimSpace(params))
	return params == "charset=utf-8" || params == `charset="utf-8"`
}

// What a JSON reader expects next (readableJSON).
const (
	wantValue = iota
	wantValueOrClose
	wantKey
	wantKeyOrClose
	wantColon
	wantCommaOrClose
	wantNothing // the body's one value is read
)

const maxDepth = 500 // Python's reader recurses per level; deeper is a RecursionError (400)

// readableJSON: the body is what Python's JSON reader reads, in one pass: JSON's grammar, every
// string's escapes JSON's and no control character in one, no number too long for Python to
// read, nothing nested too deep for it; outside strings only whitespace may be a control
// character. The members' reader only finds where each value ends (`"x": A` passes it).
func readableJSON(b []byte) bool {
	var objects [maxDepth/64 + 1]uint64 // by depth: an object (1) or an array (0)
	depth, want := 0, wantValue
	afterValue := func() {
		if depth == 0 {
			want = wantNothing
		} else {
			want = wantCommaOrClose
		}
	}
	inObject := func() bool { return objects[(depth-1)/64]&(1<<((depth-1)%64)) != 0 }
	for i := 0; i < len(b); i++ {
		c := b[i]
		value := want == wantValue || want == wantValueOrClose
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			continue
		case c == '{' || c == '[':
			if !value || depth == maxDepth {
				return false
			}
			bit := uint64(1) << (depth % 64)
			if c == '{' {
				objects[depth/64] |= bit
				want = wantKeyOrClose
			} else {
				objects[depth/64] &^= bit
				want = wantValueOrClose
			}
			depth++
			continue
		case c == '}' || c == ']':
			closes := want == wantCommaOrClose || c == '}' && want == wantKeyOrClose ||
				c == ']' && want == wantValueOrClose
			if !closes || depth == 0 || inObject() != (c == '}') {
				return false
			}
			depth--
			afterValue()
			continue
		case c == ':':
			if want != wantColon {
				return false
			}
			want = wantValue
			continue
		case c == ',':
			if want != wantCommaOrClose {
				return false
			}
			if inObject() {
				want = wantKey
			} else {
				want = wantValue
			}
			continue
		case c != '"':
			if !value {
				return false
			}
			j := i
			for j < len(b) && !tokenStop[b[j]] {
				j++
			}
			token := b[i:j]
			literal := string(token) == "true" || string(token) == "false" || string(token) == "null"
			if !literal && (len(token) > 4000 || !jsonNumber(token)) {
				return false
			}
			i = j - 1
			afterValue()
			continue
		}
		// A string: a key, or a value.
		switch want {
		case wantKey, wantKeyOrClose:
			want = wantColon
		case wantValue, wantValueOrClose:
			afterValue()
		default:
			return false
		}
		for i++; ; i++ {
			// The common case, plain text, eight bytes at a time: none below ' ', no '"', no '\\'.
			for i+8 <= len(b) {
				x := binary.LittleEndian.Uint64(b[i:])
				if below(x, ' ')|below(x^(ones*'"'), 1)|below(x^(ones*'\\'), 1) != 0 {
					break
				}
				i += 8
			}
			for i < len(b) && !stringStop[b[i]] {
				i++
			}
			if i >= len(b) {
				return false
			}
			c = b[i]
			if c == '"' {
				break
			}
			if c < ' ' {
				return false
			}
			if c == '\\' {
				if i++; i >= len(b) {
					return false
				}
				switch b[i] {
				case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				case 'u':
					if i+4 >= len(b) || unhex(b[i+1]) < 0 || unhex(b[i+2]) < 0 || unhex(b[i+3]) < 0 || unhex(b[i+4]) < 0 {
						return false
					}
					i += 4
				default:
					return false
				}
			}
		}
	}
	return want == wantNothing
}

const ones, highs = 0x0101010101010101, 0x8080808080808080

// below: nonzero when one of x's bytes is below n (n <= 128).
func below(x uint64, n uint64) uint64 {
	return (x - ones*n) & ^x & highs
}

// zeroBytes: x with the high bit of each zero byte set and every other bit clear (below(x, 1)
// says whether there is one; this says which).
func zeroBytes(x uint64) uint64 {
	return ^(((x &^ highs) + ^uint64(highs)) | x | ^uint64(highs))
}

// tokenStop: the bytes that end a number or a literal (anything else in one makes it wrong).
var tokenStop = func() (t [256]bool) {
	for _, c := range []byte(" \t\n\r,:[]{}\"") {
		t[c] = true
	}
	return t
}()

// stringStop: the bytes that end a run of a string's plain text.
var stringStop = func() (t [256]bool) {
	for c := 0; c < ' '; c++ {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return
}()

func isNull(v []byte) bool   { return string(v) == "null" }
func isBool(v []byte) bool   { return string(v) == "true" || string(v) == "false" }
func isString(v []byte) bool { return len(v) >= 2 && v[0] == '"' }
func isObject(v []byte) bool { return len(v) >= 2 && v[0] == '{' }
func emptyArray(v []byte) bool {
	return len(v) >= 2 && v[0] == '[' && skipSpace(v, 1) == len(v)-1
}

// jsonInt reads an integer literal as Python's JSON reader reads an int (no fraction, no
// exponent) of at most 18 digits; false for anything else.
func jsonInt(v []byte) (int64, bool) {
	digits := v
	if len(digits) > 0 && digits[0] == '-' {
		digits = digits[1:]
	}
	if len(digits) == 0 || len(digits) > 18 || len(digits) > 1 && digits[0] == '0' {
		return 0, false
	}
	n := int64(0)
	for _, d := range digits {
		if d < '0' || d > '9' {
			return 0, false
		}
		n = n*10 + int64(d-'0')
	}
	if len(digits) != len(v) {
		n = -n
	}
	return n, true
}

func intAtLeast(v []byte, least int64) bool {
	n, ok := jsonInt(v)
	return ok && n >= least
}

// numberWithin: a JSON number (int or float literal), finite, in [low, high] (low excluded
// with openLow).
func numberWithin(v []byte, low, high float64, openLow bool) bool {
	if !jsonNumber(v) {
		return false // NaN, Infinity: Python reads them, its schema refuses them
	}
	// The literal is only read: no copy (strconv keeps it only in an error).
	x, err := strconv.ParseFloat(unsafe.String(&v[0], len(v)), 64)
	if err != nil || math.IsInf(x, 0) {
		return false
	}
	return (x > low || !openLow && x == low) && x <= high
}

// jsonNumber: JSON's number grammar.
func jsonNumber(v []byte) bool {
	i := 0
	if i < len(v) && v[i] == '-' {
		i++
	}
	start := i
	for i < len(v) && v[i] >= '0' && v[i] <= '9' {
		i++
	}
	if i == start || i-start > 1 && v[start] == '0' {
		return false
	}
	if i < len(v) && v[i] == '.' {
		i++
		frac := i
		for i < len(v) && v[i] >= '0' && v[i] <= '9' {
			i++
		}
		if i == frac {
			return false
		}
	}
	if i < len(v) && (v[i] == 'e' || v[i] == 'E') {
		i++
		if i < len(v) && (v[i] == '+' || v[i] == '-') {
			i++
		}
		exp := i
		for i < len(v) && v[i] >= '0' && v[i] <= '9' {
			i++
		}
		if i == exp {
			return false
		}
	}
	return i == len(v)
}

// forPlainMembers: forMembers, and no key with an escape (not proven the same key as read).
func forPlainMembers(v []byte, visit func(key, value []byte) bool) bool {
	return forMembers(v, func(key, value []byte) bool {
		return bytes.IndexByte(key, '\\') < 0 && visit(key, value)
	})
}
