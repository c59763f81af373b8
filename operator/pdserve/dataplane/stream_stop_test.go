package main

import (
	"encoding/json"
	"reflect"
	"testing"
)

// streamStopCase: one of testdata/stream_stop_cases.json, which the Python gateway's test
// (tests/unit/gateway/test_stream_stop_cases.py) reads too: a streamed choice's derendered
// chunks, the stop string that ended the last, and what the client must get of each.
type streamStopCase struct {
	Name    string          `json:"name"`
	Request json.RawMessage `json:"request"`
	Steps   []struct {
		Choice json.RawMessage `json:"choice"`
		Stop   *string         `json:"stop"`
		Final  bool            `json:"final"`
		Want   json.RawMessage `json:"want"`
	} `json:"steps"`
}

func TestStopStringsAreCutAcrossChunksAsThePythonGatewayCutsThem(t *testing.T) {
	for _, c := range sharedCases[[]streamStopCase](t, "stream_stop_cases.json") {
		request, err := topLevel(c.Request)
		if err != nil {
			t.Fatal(err)
		}
		stops := newStreamStop(stopHold(request))
		for i, step := range c.Steps {
			stop := ""
			if step.Stop != nil {
				stop = *step.Stop
			}
			got := stops.correctAll(append(append([]byte("["), step.Choice...), ']'), stop, step.Final)
			var gotValue, wantValue any
			if json.Unmarshal(got, &gotValue) != nil || json.Unmarshal(append(append([]byte("["), step.Want...), ']'), &wantValue) != nil {
				t.Fatalf("%s, step %d: not JSON: %s", c.Name, i, got)
			}
			if !reflect.DeepEqual(gotValue, wantValue) {
				t.Fatalf("%s, step %d: %s, want [%s]", c.Name, i, got, step.Want)
			}
		}
	}
}
