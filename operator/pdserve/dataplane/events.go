package main

// A decode stream's events, checked as the Python gateway's _proxy_stream reads them before it
// passes them on: a JSON object, its choices (if any) objects with an integer index; every
// choice must get its finish_reason before [DONE]. Walked in place, nothing allocated: this
// runs on every event of every stream.

import (
	"encoding/json"
)

type eventVerdict int

const (
	eventOK eventVerdict = iota
	eventDone
	eventError // decode's own error event
	eventMalformed
)

type eventCheck struct {
	seen, finished uint64         // by choice index, below 64
	more           map[int64]bool // higher indexes: finished or not
	why            string         // what was malformed
}

func (c *eventCheck) check(data []byte) eventVerdict {
	if string(data) == "[DONE]" {
		return eventDone
	}
	isError, ok := false, true
	walked := eachMember(data, func(key, value []byte) {
		switch string(key) {
		case "error":
			isError = true
		case "choices":
			ok = ok && c.choices(value)
		}
	})
	switch {
	case !walked:
		c.why = "not a JSON object"
		return eventMalformed
	case !ok:
		return eventMalformed
	case isError:
		return eventError
	}
	return eventOK
}

func (c *eventCheck) choices(list []byte) bool {
	if string(list) == "null" {
		return true
	}
	ok := eachElement(list, func(choice []byte) bool {
		index, finished, valid := int64(0), false, true
		if !eachMember(choice, func(key, value []byte) {
			switch string(key) {
			case "index":
				index, valid = integer(value)
			case "finish_reason":
				finished = string(value) != "null"
			}
		}) || !valid || index < 0 {
			return false
		}
		if index < 64 {
			c.seen |= 1 << index
			if finished {
				c.finished |= 1 << index
			}
			return true
		}
		if c.more == nil {
			c.more = map[int64]bool{}
		}
		c.more[index] = c.more[index] || finished
		return true
	})
	if !ok {
		c.why = "choices are not a list of objects with an integer index"
	}
	return ok
}

// complete: some choice came, and every one came with its finish_reason.
func (c *eventCheck) complete() bool {
	for _, finished := range c.more {
		if !finished {
			return false
		}
	}
	return (c.seen != 0 || len(c.more) > 0) && c.seen == c.finished
}

func integer(raw []byte) (int64, bool) {
	if len(raw) == 0 || len(raw) > 18 {
		return 0, false
	}
	value := int64(0)
	for _, digit := range raw {
		if digit < '0' || digit > '9' {
			return 0, false
		}
		value = value*10 + int64(digit-'0')
	}
	return value, true
}

// eachMember calls visit with each member of a JSON object (its key as written, without the
// quotes); false when `object` is not one.
func eachMember(object []byte, visit func(key, value []byte)) bool {
	i := skipSpace(object, 0)
	if i >= len(object) || object[i] != '{' {
		return false
	}
	i = skipSpace(object, i+1)
	if i < len(object) && object[i] == '}' {
		return skipSpace(object, i+1) == len(object)
	}
	for {
		if i >= len(object) || object[i] != '"' {
			return false
		}
		keyEnd, err := stringEnd(object, i)
		if err != nil {
			return false
		}
		key := object[i+1 : keyEnd-1]
		i = skipSpace(object, keyEnd)
		if i >= len(object) || object[i] != ':' {
			return false
		}
		i = skipSpace(object, i+1)
		end, err := valueEnd(object, i)
		if err != nil {
			return false
		}
		visit(key, object[i:end])
		i = skipSpace(object, end)
		if i >= len(object) {
			return false
		}
		if object[i] == '}' {
			return skipSpace(object, i+1) == len(object)
		}
		if object[i] != ',' {
			return false
		}
		i = skipSpace(object, i+1)
	}
}

// eachElement calls visit with each element of a JSON array of objects until it answers
// false; false when `array` is not one, or visit answered false.
func eachElement(array []byte, visit func(element []byte) bool) bool {
	i := skipSpace(array, 0)
	if i >= len(array) || array[i] != '[' {
		return false
	}
	i = skipSpace(array, i+1)
	if i < len(array) && array[i] == ']' {
		return skipSpace(array, i+1) == len(array)
	}
	for {
		if i >= len(array) || array[i] != '{' {
			return false
		}
		end, err := valueEnd(array, i)
		if err != nil || !visit(array[i:end]) {
			return false
		}
		i = skipSpace(array, end)
		if i >= len(array) {
			return false
		}
		if array[i] == ']' {
			return skipSpace(array, i+1) == len(array)
		}
		if array[i] != ',' {
			return false
		}
		i = skipSpace(array, i+1)
	}
}

// allObjects: a non-empty array of objects, what a client's answer is made of (hasChoices,
// without allocating).
func allObjects(raw []byte) bool {
	count := 0
	return eachElement(raw, func([]byte) bool { count++; return true }) && count > 0
}

// scrubbedEvent is decode's error event as the client may see it: without the addresses its
// message names; nil when it names none (passed on as it came).
func scrubbedEvent(data []byte) []byte {
	var event map[string]any
	if json.Unmarshal(data, &event) != nil {
		return nil
	}
	failure, ok := event["error"].(map[string]any)
	if !ok {
		return nil
	}
	message, ok := failure["message"].(string)
	if !ok || withoutAddresses(message) == message {
		return nil
	}
	failure["message"] = withoutAddresses(message)
	out, err := json.Marshal(event)
	if err != nil {
		return nil
	}
	return out
}
