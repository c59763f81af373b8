package main

// Stop strings in a streamed answer behind render servers, as vLLM 0.32 streams them
// (v1/engine/detokenizer.py get_next_output_text) and as the Python gateway's
// vllm/derender_gaps.py StreamStop does (both read testdata/stream_stop_cases.json): while a
// choice goes on, the last `longest - 1` characters of its text (the request's longest stop
// string) are held back, since they may begin a stop string; its last chunk sends them, cut
// where the stop string that ended it starts (the engine stops on the token that completes it
// and derender decodes that whole token). Held text spans the text fields in the order
// derender gave them (reasoning, then content).

import (
	"bytes"
	"encoding/json"
	"strings"
	"unicode/utf8"
)

type segment struct {
	field, text string
}

type streamStop struct {
	hold int       // characters (Unicode code points, as Python counts them)
	held []segment // in order
}

// stopHold: how many characters a stream holds back: the request's longest stop string
// ("stop": a string or a list) less one; none with include_stop_str_in_output.
func stopHold(request []member) int {
	if string(lookup(request, "include_stop_str_in_output")) == "true" {
		return 0
	}
	raw := lookup(request, "stop")
	var stops []string
	var one string
	if json.Unmarshal(raw, &one) == nil {
		stops = []string{one}
	} else {
		var listed []any
		if json.Unmarshal(raw, &listed) == nil {
			for _, each := range listed {
				if s, ok := each.(string); ok {
					stops = append(stops, s)
				}
			}
		}
	}
	longest := 0
	for _, s := range stops {
		longest = max(longest, utf8.RuneCountInString(s))
	}
	return max(0, longest-1)
}

func newStreamStop(hold int) *streamStop { return &streamStop{hold: hold} }

// correct: a derendered chunk's choice (a JSON object) as vLLM would stream it: `stop`, the
// stop string that ended it ("" when none did); `final`, its last chunk. The choice's own bytes
// come back when nothing changed.
func (s *streamStop) correct(choice []byte, stop string, final bool) []byte {
	if s.hold == 0 && stop == "" {
		return choice
	}
	members, err := topLevel(choice)
	if err != nil {
		return choice
	}
	delta := lookup(members, "delta")
	deltaFields, deltaErr := topLevel(delta)
	names, from := []string{"text"}, members
	if deltaErr == nil {
		names, from = []string{"reasoning", "content"}, deltaFields
	}
	var present []string
	pending := append([]segment(nil), s.held...)
	for _, name := range names {
		raw := lookup(from, name)
		var text string
		if len(raw) == 0 || raw[0] != '"' || json.Unmarshal(raw, &text) != nil {
			continue
		}
		present = append(present, name)
		if text != "" {
			pending = append(pending, segment{name, text})
		}
	}
	var released []segment
	if final {
		s.held = nil
		released = pending
		if stop != "" {
			var joined strings.Builder
			for _, each := range pending {
				joined.WriteString(each.text)
			}
			if at := strings.Index(joined.String(), stop); at >= 0 {
				released, _ = splitSegments(pending, utf8.RuneCountInString(joined.String()[:at]))
			}
		}
	} else {
		total := 0
		for _, each := range pending {
			total += utf8.RuneCountInString(each.text)
		}
		released, s.held = splitSegments(pending, max(0, total-s.hold))
	}
	byField := map[string]string{}
	var order []string
	for _, each := range released {
		if _, seen := byField[each.field]; !seen {
			order = append(order, each.field)
		}
		byField[each.field] += each.text
	}
	var set []field
	for _, name := range present {
		set = append(set, field{name, quoted(byField[name])})
		delete(byField, name)
	}
	for _, name := range order { // released from a field this chunk does not carry
		if text, left := byField[name]; left {
			set = append(set, field{name, quoted(text)})
		}
	}
	if len(set) == 0 {
		return choice
	}
	drops := map[string]bool{}
	for _, f := range set {
		drops[f.key] = true
	}
	var out bytes.Buffer
	if deltaErr != nil {
		splice(&out, choice, members, drops, set)
		return out.Bytes()
	}
	var fixed bytes.Buffer
	splice(&fixed, delta, deltaFields, drops, set)
	splice(&out, choice, members, map[string]bool{"delta": true}, []field{{"delta", fixed.Bytes()}})
	return out.Bytes()
}

// splitSegments: the first `count` characters of the segments, and the rest.
func splitSegments(segments []segment, count int) (first, rest []segment) {
	for _, each := range segments {
		n := utf8.RuneCountInString(each.text)
		switch {
		case count >= n:
			first = append(first, each)
			count -= n
		case count > 0:
			at := runeOffset(each.text, count)
			first = append(first, segment{each.field, each.text[:at]})
			rest = append(rest, segment{each.field, each.text[at:]})
			count = 0
		default:
			rest = append(rest, each)
		}
	}
	return first, rest
}

// runeOffset: the byte offset of the n-th character of text.
func runeOffset(text string, n int) int {
	at := 0
	for ; n > 0 && at < len(text); n-- {
		_, size := utf8.DecodeRuneInString(text[at:])
		at += size
	}
	return at
}

// correctAll: every choice of a chunk's "choices" array corrected; the array's own bytes come
// back when nothing changed.
func (s *streamStop) correctAll(choices []byte, stop string, final bool) []byte {
	elements, err := arrayElements(choices)
	if err != nil {
		return choices
	}
	var list bytes.Buffer
	list.WriteByte('[')
	changed := false
	for i, at := range elements {
		choice := choices[at.start:at.end]
		fixed := s.correct(choice, stop, final)
		changed = changed || !bytes.Equal(fixed, choice)
		if i > 0 {
			list.WriteByte(',')
		}
		list.Write(fixed)
	}
	list.WriteByte(']')
	if !changed {
		return choices
	}
	return list.Bytes()
}
