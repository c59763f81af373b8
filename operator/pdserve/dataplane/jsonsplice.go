package main

// A request body is forwarded twice (prefill, then decode) with a few top-level members
// changed. Decoding and re-encoding a 200 KB prompt twice is what made large prompts cost the
// Python gateway several times a small one; here the body is scanned once for its top-level
// members and each upstream body is spliced from the original bytes.

import (
	"bytes"
	"encoding/binary"
	"errors"
)

// member is one top-level "key": value of a JSON object, as spans of the original bytes.
type member struct {
	key        string // unescaped only when it has no escapes (keys the route reads never do)
	start, end int    // the whole `"key": value`, for copying
	value      []byte
}

var errNotObject = errors.New("the request body is not a JSON object")

// topLevel finds the members of a JSON object. It checks the structure it walks (strings,
// nesting, separators), not every literal: the engines validate the body in full, and
// anything this cannot walk goes to the Python gateway, which names the field.
func topLevel(body []byte) ([]member, error) {
	return appendMembers(make([]member, 0, 16), body)
}

// appendMembers is topLevel appending to `members` (a caller's reused slice).
func appendMembers(members []member, body []byte) ([]member, error) {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return nil, errNotObject
	}
	i = skipSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		if skipSpace(body, i+1) != len(body) {
			return nil, errNotObject
		}
		return members, nil
	}
	for {
		if i >= len(body) || body[i] != '"' {
			return nil, errNotObject
		}
		start := i
		keyEnd, err := stringEnd(body, i)
		if err != nil {
			return nil, err
		}
		key := string(body[i+1 : keyEnd-1])
		i = skipSpace(body, keyEnd)
		if i >= len(body) || body[i] != ':' {
			return nil, errNotObject
		}
		i = skipSpace(body, i+1)
		valueEnd, err := valueEnd(body, i)
		if err != nil {
			return nil, err
		}
		members = append(members, member{key: key, start: start, end: valueEnd, value: body[i:valueEnd]})
		i = skipSpace(body, valueEnd)
		if i >= len(body) {
			return nil, errNotObject
		}
		if body[i] == '}' {
			if skipSpace(body, i+1) != len(body) {
				return nil, errNotObject
			}
			return members, nil
		}
		if body[i] != ',' {
			return nil, errNotObject
		}
		i = skipSpace(body, i+1)
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && jsonSpace(b[i]) {
		i++
	}
	return i
}

// jsonSpace: whitespace as JSON's grammar has it.
func jsonSpace(c byte) bool { return c == ' ' || c == '\n' || c == '\r' || c == '\t' }

// stringEnd: the index after the closing quote of the string opening at i.
func stringEnd(b []byte, i int) (int, error) {
	j := i + 1
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return 0, errNotObject
		}
		j += k
		backslashes := 0
		for p := j - 1; p > i && b[p] == '\\'; p-- {
			backslashes++
		}
		j++
		if backslashes%2 == 0 {
			return j, nil
		}
	}
}

// valueEnd: the index after the value starting at i.
func valueEnd(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errNotObject
	}
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			for j+8 <= len(b) && plainWord(binary.LittleEndian.Uint64(b[j:])) {
				j += 8 // a token id array is nearly all digits and commas
			}
			if j >= len(b) {
				break
			}
			switch b[j] {
			case '"':
				end, err := stringEnd(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, errNotObject
	default: // a number, true, false or null
		j := i
		for j < len(b) && !bytes.ContainsRune([]byte(" \t\r\n,}]"), rune(b[j])) {
			j++
		}
		if j == i {
			return 0, errNotObject
		}
		return j, nil
	}
}

// plainWord: none of x's eight bytes is a quote, bracket or brace. (c & 0xd9) == 0x59 holds
// for [ ] { } and for Y _ y DEL, which only send the word to be read byte by byte.
func plainWord(x uint64) bool {
	return below((x&(0xd9*ones))^(0x59*ones), 1)|below(x^('"'*ones), 1) == 0
}

// duplicated: a key given twice (JSON readers disagree on which one counts).
func duplicated(members []member) bool {
	for i := range members {
		for j := i + 1; j < len(members); j++ {
			if members[i].key == members[j].key {
				return true
			}
		}
	}
	return false
}

// lookup returns a member's value, nil when absent.
func lookup(members []member, key string) []byte {
	for i := range members {
		if members[i].key == key {
			return members[i].value
		}
	}
	return nil
}

// field is a member to write: a key and its encoded value.
type field struct {
	key   string
	value []byte
}

// splice writes the object `body` without the members named in drop, then the extra fields.
func splice(dst *bytes.Buffer, body []byte, members []member, drop map[string]bool, extra []field) {
	dst.Grow(len(body) + 256)
	dst.WriteByte('{')
	first := true
	for i := range members {
		if drop[members[i].key] {
			continue
		}
		if !first {
			dst.WriteByte(',')
		}
		first = false
		dst.Write(body[members[i].start:members[i].end])
	}
	for _, f := range extra {
		if !first {
			dst.WriteByte(',')
		}
		first = false
		dst.WriteByte('"')
		dst.WriteString(f.key)
		dst.WriteString(`":`)
		dst.Write(f.value)
	}
	dst.WriteByte('}')
}

// forMembers calls visit with each member of the JSON object v (its key as written, without the
// quotes) until visit answers false; false when v is not one object (white space around it
// allowed) or visit answered false. The one walk over an object's members, allocating nothing:
// the fast path's validation and a stream's event checks both run it on every request.
func forMembers(v []byte, visit func(key, value []byte) bool) bool {
	i := skipSpace(v, 0)
	if i >= len(v) || v[i] != '{' {
		return false
	}
	i = skipSpace(v, i+1)
	if i < len(v) && v[i] == '}' {
		return skipSpace(v, i+1) == len(v)
	}
	for {
		if i >= len(v) || v[i] != '"' {
			return false
		}
		keyEnd, err := stringEnd(v, i)
		if err != nil {
			return false
		}
		key := v[i+1 : keyEnd-1]
		i = skipSpace(v, keyEnd)
		if i >= len(v) || v[i] != ':' {
			return false
		}
		i = skipSpace(v, i+1)
		end, err := valueEnd(v, i)
		if err != nil || !visit(key, v[i:end]) {
			return false
		}
		i = skipSpace(v, end)
		if i >= len(v) {
			return false
		}
		if v[i] == '}' {
			return skipSpace(v, i+1) == len(v)
		}
		if v[i] != ',' {
			return false
		}
		i = skipSpace(v, i+1)
	}
}

// allItems: v is a JSON array (white space around it allowed) whose every item passes.
func allItems(v []byte, each func(item []byte) bool) bool {
	i := skipSpace(v, 0)
	if i >= len(v) || v[i] != '[' {
		return false
	}
	i = skipSpace(v, i+1)
	if i < len(v) && v[i] == ']' {
		return skipSpace(v, i+1) == len(v)
	}
	for {
		end, err := valueEnd(v, i)
		if err != nil || !each(v[i:end]) {
			return false
		}
		i = skipSpace(v, end)
		if i >= len(v) {
			return false
		}
		if v[i] == ']' {
			return skipSpace(v, i+1) == len(v)
		}
		if v[i] != ',' {
			return false
		}
		i = skipSpace(v, i+1)
	}
}
