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
	walked := forMembers(data, func(key, value []byte) bool {
		switch string(key) {
		case "error":
			isError = true
		case "choices":
			ok = ok && c.choices(value)
		}
		return true
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
	ok := allItems(list, func(choice []byte) bool {
		index, finished, valid := int64(0), false, true
		if !forMembers(choice, func(key, value []byte) bool {
			switch string(key) {
			case "index":
				index, valid = jsonInt(value)
			case "finish_reason":
				finished = string(value) != "null"
			}
			return true
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

// allObjects: a non-empty array of objects, what a client's answer is made of (hasChoices,
// without allocating).
func allObjects(raw []byte) bool {
	count := 0
	return allItems(raw, func(item []byte) bool { count++; return isObject(item) }) && count > 0
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
